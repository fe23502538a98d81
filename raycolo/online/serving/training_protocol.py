"""raycolo's own routes' bodies: training samples (``/v1/train_samples``, ``/v1/eval``), the
training status and the deployment's health (re-exported by :mod:`.protocol`)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, model_validator

from raycolo.online.serving.chat_messages import ChatMessage, Text

MAX_TRAIN_SAMPLES = 1024                      # per POST /v1/train_samples


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# -- raycolo's routes -----------------------------------------------------------------------
class TrainSample(_Strict):
    """A training sample: ``prompt`` and ``completion`` texts; chat ``messages`` whose last
    message is the assistant's (the completion); or a preference pair, ``prompt`` (or chat
    ``messages`` ending with the user's turn) with the ``chosen`` and the ``rejected``
    completion (trained with the DPO loss against the frozen base). Chat samples are
    rendered with the model's chat template: the completion is the assistant's turn as the
    template writes it, ending with its end-of-turn token (raycolo.online.serving.text)."""

    prompt: Optional[Text] = None
    completion: Optional[Text] = None
    chosen: Optional[Text] = None
    rejected: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)

    @property
    def is_pair(self) -> bool:
        return self.chosen is not None or self.rejected is not None

    @model_validator(mode="after")
    def _one_form(self):
        if self.messages is not None and self.prompt is not None:
            raise ValueError("give prompt or messages, not both")
        if self.completion is not None and self.is_pair:
            raise ValueError("give completion, or chosen and rejected, not both")
        if self.messages is None and self.prompt is None:
            raise ValueError("give prompt and completion, prompt (or messages) with chosen and rejected, "
                             "or messages")
        if self.prompt is not None and not self.is_pair and not self.completion:
            raise ValueError("prompt and a non-empty completion are both required")
        if self.is_pair and (not self.chosen or not self.rejected):
            raise ValueError("a preference pair needs non-empty chosen and rejected")
        if self.is_pair and self.chosen == self.rejected:
            raise ValueError("chosen and rejected must differ")
        if self.messages is not None and not self.is_pair:
            if self.completion is not None:
                raise ValueError("messages carry the completion as their last (assistant) message")
            if len(self.messages) < 2 or self.messages[-1].role != "assistant":
                raise ValueError("the last message must be the assistant's (the completion)")
        if self.messages is not None and self.is_pair and self.messages[-1].role == "assistant":
            raise ValueError("a chat preference pair's messages end before the assistant's answer "
                             "(chosen and rejected are the answers)")
        return self


class TrainSamplesRequest(_Strict):
    samples: list[TrainSample] = Field(min_length=1, max_length=MAX_TRAIN_SAMPLES)


# The two forms of a training body, as tags of the union below. Pydantic puts the tag in an
# error's location; both hold a "[", so param_path leaves them out of the named parameter:
# ``samples[3].completion`` in the object form, ``[3].completion`` in the bare list.
SAMPLES_OBJECT, SAMPLES_LIST = '{"samples": [...]}', "[...]"


def _samples_form(body) -> Optional[str]:
    return SAMPLES_OBJECT if isinstance(body, dict) else SAMPLES_LIST if isinstance(body, list) else None


class TrainSamplesBody(RootModel):
    """POST /v1/train_samples and /v1/eval: ``{"samples": [...]}`` or a bare JSON list of
    samples, with the same validation and limits (1 to MAX_TRAIN_SAMPLES samples)."""

    root: Annotated[Union[
        Annotated[TrainSamplesRequest, Tag(SAMPLES_OBJECT)],
        Annotated[list[TrainSample], Field(min_length=1, max_length=MAX_TRAIN_SAMPLES), Tag(SAMPLES_LIST)]],
        Discriminator(_samples_form, custom_error_type="invalid_body",
                      custom_error_message='the body must be {"samples": [...]} or a JSON list of samples')]

    @property
    def samples(self) -> list[TrainSample]:
        return self.root.samples if isinstance(self.root, TrainSamplesRequest) else self.root

    @property
    def param(self) -> str:
        """The samples' parameter path in this body: ``samples``, or ``""`` (the body itself)."""
        return "samples" if isinstance(self.root, TrainSamplesRequest) else ""


class EvalResponse(BaseModel):
    loss: Optional[float] = Field(default=None, description="mean next-token loss over the samples' "
                                  "completions, no training ((prompt, completion) samples)")
    win_rate: Optional[float] = Field(default=None, description="preference pairs: the fraction where the "
                                      "chosen completion is more probable than the rejected one")
    clpd: Optional[float] = Field(default=None, description="preference pairs: the mean log-probability "
                                  "of the chosen completion minus the rejected one's")
    samples: int
    adapter_version: int


class TrainSamplesResponse(BaseModel):
    ids: list[int] = Field(description="the samples' sequence numbers in the store")
    sequence: int = Field(description="the store's sequence number after this append (samples stored)")
    persisted: bool = Field(description="always true: fsynced before this answer")


class TrainStatus(BaseModel):
    received: int
    trained: int
    pending: int
    adapter_version: int
    last_checkpoint: Optional[dict] = None
    pinned_versions: list[int] = Field(default_factory=list,
                                       description="adapter versions servable as <model>@v<k>")
    resumed: Optional[dict] = Field(default=None, description="what this deployment took up from an earlier "
                                    "one on the same storage: adapter_version, samples_held, samples_resumed")


class Health(BaseModel):
    status: Literal["ok", "degraded", "starting"]
    nodes_alive: int
    nodes: int
    nodes_restarting: int = Field(default=0, description="nodes whose worker group is being restarted: "
                                  "alive, but given no new work until it is back")
