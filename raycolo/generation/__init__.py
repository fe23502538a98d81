"""Generation semantics, declared once: what vLLM's ``SamplingParams``, sampler and stop
checker own. Pure (torch for the sampler, no Ray); the offline torch engine, the vLLM
adapter, the online stage pipeline and the HTTP front all use it.

* :mod:`.params`: :class:`SamplingParams` (names, defaults and bounds as vLLM's).
* :mod:`.stops`: the EOS set of a checkpoint, the stop checker, finish reasons, the
  token accounting.
* :mod:`.detokenize`: token ids to text deltas, stop strings held back and cut.
* :mod:`.sampler`: penalties, min_tokens, temperature, top-k, top-p, seeded draws and
  log-probabilities, for a batch of rows.
"""
from raycolo.generation.params import SamplingParams, GREEDY_EPS
from raycolo.generation.stops import (FinishReason, StopChecker, check_stop, eos_token_ids, output_text,
                                      stop_token_set)
from raycolo.generation.detokenize import TextStream

__all__ = ["SamplingParams", "GREEDY_EPS", "FinishReason", "StopChecker", "check_stop", "eos_token_ids",
           "output_text", "stop_token_set", "TextStream"]
