"""The training-sample store and the online deployment config (pure Python)."""
from __future__ import annotations

import json
import re

import pytest

from raycolo.errors import ConfigError
from raycolo.online.config import layer_bounds, parse_online_config
from raycolo.online.samples import (Cursor, SampleStore, TrainingLedger, clip_sample, from_ranges, load_cursor,
                                    plan_resumption, save_cursor, to_ranges, training_rows)


def test_append_persists_before_it_returns_and_survives_a_reload(tmp_path):
    store = SampleStore(tmp_path)
    assert store.append([([1, 5, 6], [7, 8]), ([1, 9], [10])]) == [0, 1]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in rows] == [0, 1] and rows[1]["completion"] == [10]
    store.close()
    again = SampleStore(tmp_path)                       # a new process reads what was acked
    assert len(again) == 2 and again.append([([1], [2])]) == [2]


def test_preference_pairs_are_stored_with_their_rejected_answer_and_split_into_rows(tmp_path):
    store = SampleStore(tmp_path)
    assert store.append([([1, 5], [7, 8], [9]), ([1], [2])]) == [0, 1]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows[0]["rejected"] == [9] and "rejected" not in rows[1]
    store.close()
    pair, plain = SampleStore(tmp_path).get([0, 1])
    assert pair.is_pair and pair.ids() == ((1, 5), (7, 8), (9,)) and not plain.is_pair and plain.ids() == ((1,), (2,))
    assert training_rows([pair.ids(), ((1,), (3,), (4,))]) == \
        ([((1, 5), (7, 8)), ((1,), (3,)), ((1, 5), (9,)), ((1,), (4,))], True)
    assert training_rows([plain.ids()]) == ([((1,), (2,))], False)
    assert clip_sample(([1, 2, 3], [4, 5], [6, 7, 8]), 4) == ([1, 2, 3], [4], [6])


def test_a_torn_last_line_was_never_acknowledged_and_is_dropped(tmp_path):
    store = SampleStore(tmp_path)
    store.append([([1, 2], [3])])
    store.close()
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"seq": 1, "prompt": [1')               # a crash mid-write
    again = SampleStore(tmp_path)
    assert len(again) == 1 and again.append([([5], [6])]) == [1]   # the torn line is cut, not merged
    again.close()
    assert [s.completion for s in SampleStore(tmp_path).get([0, 1])] == [(3,), (6,)]


def _append_many(directory: str, tag: int, batches: int, at: float) -> list:
    import time

    store = SampleStore(directory)
    time.sleep(max(0.0, at - time.time()))      # both processes start appending at once
    out = [store.append([([tag], [i]), ([tag], [i, i])], post=f"{tag}-{i}") for i in range(batches)]
    store.close()
    return out


def test_two_processes_appending_at_once_get_dense_distinct_seqs_in_file_order(tmp_path):
    """The controller and a replica (here: two processes) append to one store at once: no
    seq is given twice, the file's rows are in seq order with none lost, and each batch's
    two samples got consecutive seqs."""
    import multiprocessing
    import time

    at = time.time() + 3.0
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a, b = pool.starmap(_append_many, [(str(tmp_path), 1, 150, at), (str(tmp_path), 2, 150, at)])
    seqs = [seq for batch in a + b for seq in batch]
    assert sorted(seqs) == list(range(600))
    assert all(batch[1] == batch[0] + 1 for batch in a + b)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["seq"] for r in rows] == list(range(600))
    again = SampleStore(tmp_path)
    assert [again.get([x[0]])[0].completion for x in a[:2]] == [(0,), (1,)]
    assert [again.get([x[1]])[0].prompt for x in b[-2:]] == [(2,), (2,)]


def test_a_store_takes_what_another_writer_appended_and_a_post_key_stores_once(tmp_path):
    """The controller's store sees the samples a replica stored while it was down (pending,
    take); a batch sent again under the same post key (its first sender did not learn
    whether it was stored) gets the same seqs and stores nothing."""
    controller, replica = SampleStore(tmp_path), SampleStore(tmp_path)
    assert controller.append([([1], [2])], post="p0") == [0]
    assert replica.append([([3], [4]), ([5], [6])], post="p1") == [1, 2]
    assert controller.pending(Cursor()) == 3
    batch, cursor = controller.take(Cursor(0, 1), 5)
    assert [s.prompt for s in batch] == [(3,), (5,)] and cursor == Cursor(0, 3)
    assert controller.append([([3], [4]), ([5], [6])], post="p1") == [1, 2]    # the retry: stored once
    assert replica.append([([1], [2])], post="p0") == [0]
    assert controller.append([([7], [8])]) == [3] and len(replica) == 4
    controller.close()
    replica.close()
    assert len(SampleStore(tmp_path)) == 4
    with pytest.raises(ConfigError, match=r"samples\[0\]\.completion"):
        SampleStore(tmp_path).append([([1], [])], post="p9")


def test_take_trains_each_sample_once_per_epoch_in_order(tmp_path):
    store = SampleStore(tmp_path)
    store.append([([1], [i]) for i in range(5)])
    cursor, seen = Cursor(), []
    for _ in range(4):
        batch, cursor = store.take(cursor, 2)
        seen.append([s.completion[0] for s in batch])
    assert seen == [[0, 1], [2, 3], [4], [0, 1]]        # epoch 0, then epoch 1 starts over
    assert cursor == Cursor(epoch=1, next_seq=2) and store.pending(cursor) == 3
    save_cursor(tmp_path / "cursor.json", cursor)
    assert load_cursor(tmp_path / "cursor.json") == cursor
    assert load_cursor(tmp_path / "none.json") is None


@pytest.mark.parametrize("sample,message", [
    (([], [1]), "samples[0].prompt: must be a non-empty list of token ids"),
    (([1], "abc"), "samples[0].completion: must be a non-empty list of token ids"),
    (([1, -2], [1]), "samples[0].prompt: token ids must be non-negative integers"),
    (([1, True], [1]), "samples[0].prompt: token ids must be non-negative integers"),
    (([1, 2.5], [1]), "samples[0].prompt: token ids must be non-negative integers"),
    (([1], [2], [2]), "samples[0].rejected: must differ from chosen"),
    (([1], [2], []), "samples[0].rejected: must be a non-empty list of token ids"),
    (([1],), "samples[0]: must be (prompt, completion) or (prompt, chosen, rejected)"),
    (([1], [2], [3], [4]), "samples[0]: must be (prompt, completion) or (prompt, chosen, rejected)"),
])
def test_bad_samples_are_refused_and_nothing_is_stored(tmp_path, sample, message):
    store = SampleStore(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        store.append([([1], [2]), sample][::-1])
    assert len(store) == 0 and (tmp_path / "samples.jsonl").read_text() == ""


def test_config_defaults_and_errors_name_the_field():
    config = parse_online_config({})
    assert (config.nodes, config.stages, config.policy, config.lora.rank) == (2, 2, "lemix", 8)
    assert config.gpus_needed() == 4
    assert parse_online_config({"nodes": 3, "stage": {"gpus_per_worker": 0.5}}).gpus_needed() == 3
    for values, where in (({"nodes": 0}, "config: nodes:"), ({"policy": "fifo"}, "config: policy: unknown"),
                          ({"lora": {"lr": float("nan")}}, "config: lora.lr:"),
                          ({"lemix": {"max_batch": 10 ** 30}}, "config: lemix.max_batch:"),
                          ({"typo": 1}, "config: typo:"), ([], "config: must be a mapping"),
                          ({"stage": {"gpus_per_worker": 0}}, "config: stage.gpus_per_worker:"),
                          ({"stage": {"gpus_per_worker": 0.5, "backend": "nccl"}},
                           "config: stage.gpus_per_worker: below 1, stages share a GPU")):
        with pytest.raises(ConfigError) as err:
            parse_online_config(values)
        assert str(err.value).startswith(where), str(err.value)


def test_layer_bounds_cut_contiguous_near_equal_slices():
    assert layer_bounds(8, 2) == [0, 4, 8]
    assert layer_bounds(7, 3) == [0, 3, 5, 7]
    assert layer_bounds(2, 2) == [0, 1, 2]
    with pytest.raises(ConfigError, match="stages: 3 stages for a model of 2 decoder layers"):
        layer_bounds(2, 3)


def test_the_shipped_online_example_loads():
    from pathlib import Path

    from raycolo.online.config import load_online_config, model_hf_config

    config = load_online_config(Path(__file__).resolve().parents[2] / "examples" / "online.yaml")
    assert (config.nodes, config.stages, config.policy) == (2, 2, "lemix")
    bounds = layer_bounds(model_hf_config(config.model_loading_config.model_id).num_hidden_layers, config.stages)
    assert bounds[0] == 0 and len(bounds) == config.stages + 1


def test_ledger_rolls_back_to_the_restored_checkpoint_and_hands_back_the_rest():
    ledger = TrainingLedger(2)
    ledger.train(0, [0, 1])
    ledger.report(0, 1)
    ledger.train(0, [2, 3])          # after the report: not in checkpoint 1
    ledger.commit(0, 1)
    assert ledger.version == [1, 0] and ledger.since[0] == [2, 3]
    ledger.train(1, [4])
    ledger.train(0, [5])
    ledger.report(0, 2)              # holds 0-3 and 5; its commit has not been reported
    ledger.lose(0)
    assert ledger.restoring(0) and ledger.trained == {0: 1, 1: 1, 2: 0, 3: 0, 4: 1, 5: 0}
    assert ledger.restore(0, 1) == [2, 3, 5]              # back to checkpoint 1
    assert ledger.version[0] == 1 and not ledger.restoring(0)
    ledger.train(0, [2, 3, 5])
    assert set(ledger.trained.values()) == {1}

    ledger.train(0, [6])
    ledger.report(0, 3)              # Ray Train commits 3 but the group dies before we hear
    ledger.lose(0)
    assert ledger.restore(0, 3) == [] and ledger.version[0] == 3   # 3 came back: it holds 6
    assert ledger.trained[6] == 1

    ledger.train(1, [7])
    ledger.lose(1)
    ledger.lose(1)                   # a second failure before the group came back
    assert ledger.abandon(1) == [4, 7] and ledger.trained[4] == 0 == ledger.trained[7]


def test_the_ledger_says_what_a_checkpoint_taken_now_holds():
    ledger = TrainingLedger(1)
    ledger.train(0, [0, 1])
    ledger.report(0, 1)
    ledger.commit(0, 1)
    ledger.train(0, [2])
    assert ledger.holds(0) == [0, 1, 2]
    ledger.train(0, [3])
    ledger.lose(0)                   # 2 and 3 were not in checkpoint 1
    assert ledger.holds(0) == [0, 1]
    assert ledger.restore(0, 1) == [2, 3]
    assert ledger.holds(0) == [0, 1]


@pytest.mark.parametrize("seqs", [[], [5], [0, 1, 2, 7, 9, 10], [3, 1, 2, 2]])
def test_seq_ranges_round_trip(seqs):
    runs = to_ranges(seqs)
    assert from_ranges(runs) == sorted(set(seqs))
    assert all(a < b for a, b in runs) and all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))


def test_a_resumed_deployment_trains_exactly_the_stored_samples_no_checkpoint_holds():
    # node 0's checkpoint v3 holds 0-4, node 1's v5 holds 5-6 and 9; 12 samples are stored
    restored = {0: (3, [0, 1, 2, 3, 4], Cursor(0, 8)), 1: (5, [5, 6, 9], Cursor(0, 10))}
    plan = plan_resumption(restored, 12)
    assert plan.pending == [7, 8, 10, 11] and plan.held == 8
    assert plan.adapter_version == 5 and plan.cursor == Cursor(0, 12)
    # nothing restored: every stored sample is pending, the version counts from 0
    fresh = plan_resumption({}, 3)
    assert fresh.pending == [0, 1, 2] and fresh.adapter_version == 0
    # a later pass over the store: from the newest checkpoint's cursor on
    later = plan_resumption({0: (9, [0, 1, 2], Cursor(1, 2))}, 4)
    assert later.pending == [2, 3] and later.cursor == Cursor(1, 4)

    ledger = TrainingLedger(2)
    for node, (version, seqs, _) in restored.items():
        ledger.resume(node, version, seqs)
    assert ledger.version == [3, 5] and ledger.holds(1) == [5, 6, 9]
    ledger.train(1, [7])
    ledger.report(1, 6)
    ledger.commit(1, 6)
    assert ledger.holds(1) == [5, 6, 9, 7] and sum(1 for v in ledger.trained.values() if v) == 9


def test_a_full_disk_refuses_the_batch_whole_and_keeps_what_was_acknowledged(tmp_path):
    """The store's file handle on a device that is always full (/dev/full: every write
    fails with ENOSPC): append raises StoreFull naming the file, nothing is counted as
    stored, and once the store is back on its own file the refused batch's buffered text
    never reaches it."""
    from raycolo.errors import StoreFull

    store = SampleStore(tmp_path)
    store.append([([1], [2])])
    store._journal._file.close()
    store._journal._file = open("/dev/full", "a", encoding="utf-8")     # the disk fills up
    with pytest.raises(StoreFull, match=r"samples.jsonl: No space left on device; nothing was stored"):
        store.append([([1], [2]), ([3], [4])])
    assert len(store) == 1
    assert store.append([([7], [8])]) == [1]                 # space again: the store reopened its file
    store.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["completion"]) for r in rows] == [(0, [2]), (1, [8])]


def test_a_failed_write_is_cut_back_so_the_file_holds_only_acknowledged_samples(tmp_path):
    """A write that fails (here: the store's descriptor went bad under it) leaves the file
    as it was before the batch, and the store goes on."""
    import os

    from raycolo.errors import StoreFull

    store = SampleStore(tmp_path)
    store.append([([1], [2])])
    before = (tmp_path / "samples.jsonl").read_bytes()
    os.close(store._journal._file.fileno())           # the descriptor goes bad under the store
    with pytest.raises(StoreFull, match="nothing was stored"):
        store.append([([3], [4])])
    assert (tmp_path / "samples.jsonl").read_bytes() == before and len(store) == 1
    assert store.append([([5], [6])]) == [1]   # the store reopened its file and goes on
    store.close()
    assert len(SampleStore(tmp_path)) == 2


@pytest.mark.parametrize("model", ["tiny-llama-s", "tiny-qwen2-s", "tiny-mistral-s", "llama3", "qwen2", "qwen3"])
def test_the_controller_reads_the_model_shape_without_transformers(model, hf_checkpoints, tmp_path, request):
    """What a (re)starting controller derives from the model's config.json or catalog
    shape (layer bounds, the prior profile) is what transformers' config gives."""
    from raycolo.online.config import live_profile, model_fields, model_hf_config

    model_id = (str(request.getfixturevalue("qwen3_checkpoint")) if model == "qwen3"      # head_dim != hidden / heads
                else str(hf_checkpoints[model]) if model in hf_checkpoints else model)
    cfg = parse_online_config({"model_loading_config": {"model_id": model_id}, "stages": 2}, "config")
    fields, hf = model_fields(model_id), model_hf_config(model_id)
    assert int(fields["num_hidden_layers"]) == hf.num_hidden_layers
    assert live_profile(cfg, fields) == live_profile(cfg, hf)
    with pytest.raises(ConfigError, match=r"model_loading_config\.model_id: .* has no config\.json"):
        model_fields(str(tmp_path))


def test_the_controller_module_imports_neither_torch_nor_transformers():
    """A restarted controller serves sooner for not importing torch (1.3 s here) or
    transformers (1.2 s) before it takes requests (docs/online-live.md)."""
    import subprocess
    import sys

    code = ("import sys; import raycolo.actors.online.controller; "
            "from raycolo.online.config import model_fields; model_fields('tiny-llama-s'); "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
