"""The sample pump: training samples persisted (fsynced) before they are acknowledged, and
turned into training tasks a micro-batch at a time, at most ``lora.queued_tasks`` per
node outstanding.

A role of the online controller (``ctl.<role>``, see :mod:`.state`)."""
from __future__ import annotations

import asyncio
from typing import Optional


from raycolo.online.samples import Cursor, SampleStore, clip_sample, training_rows
from raycolo.online.tasks import OnlineTask, TaskKind


class SamplePump:
    def __init__(self, ctl) -> None:
        """This role's own state (it alone writes these); ``ctl`` is the OnlineController."""
        self.ctl = ctl
        self.store = SampleStore(self.ctl.config.sample_store)
        self.cursor = Cursor()
        self.train_tasks: dict[int, list] = {}
        self.train_seqs: dict[int, list[int]] = {}          # training task -> its samples' seqs
        self.auto_train = False                       # samples arrive over HTTP: train them as they come
        self._flush_timer: Optional[asyncio.TimerHandle] = None   # trains a partial micro-batch of HTTP samples
        self.backlog: list[int] = []                  # resumed samples to train, fed in as training tasks finish

    def trained(self, root: int) -> list[int]:
        """Training task ``root`` took its optimizer step: it is done here; its samples' seqs."""
        self.train_tasks.pop(root, None)
        return self.train_seqs.pop(root, [])

    def resume_samples(self, cursor, pending) -> None:
        """Take up an earlier deployment's samples: the store's ``cursor`` after those its
        adapters hold, and the ``pending`` ones to train first."""
        self.cursor, self.backlog = cursor, list(pending)

    def pending(self) -> int:
        """Acknowledged samples not yet handed to training: past the cursor, and resumed ones."""
        return self.store.pending(self.cursor) + len(self.backlog)

    async def stored_samples(self, seqs: list) -> list[tuple]:
        """The stored samples ``seqs`` as token ids: (prompt, completion) or (prompt,
        chosen, rejected), as training takes them."""
        return [tuple(list(part) for part in s.ids()) for s in self.store.get(seqs)]

    async def add_samples(self, samples: list, train: bool = False, post: Optional[str] = None) -> dict:
        """Persist training samples (fsynced) before acknowledging them: (prompt,
        completion) token ids, or preference pairs (prompt, chosen, rejected). With ``train``
        (the HTTP front), every full micro-batch of pending samples becomes a training task.
        ``post``: the batch's key; a batch stored under it already (by a replica while this
        controller was down, or before a reply that was lost) is not stored again."""
        seqs = self.store.append([tuple(x) for x in samples], post=post)   # (prompt, completion) or pairs
        if train:
            self.auto_train = True
            if self.ctl.ready.is_set():
                self.pump_training()
            else:                      # a restarted controller: pumped once its workers are back
                self.ctl.workers.wake()
        return {"ids": seqs, "stored": len(self.store)}

    def pump_training(self, flush: bool = False) -> None:
        """Samples that came over HTTP: full micro-batches of pending samples become training
        tasks, at most ``lora.queued_tasks`` per node outstanding (more follow as they finish).
        A partial micro-batch is trained as it is once it waited ``lora.flush_after_s``
        (``flush``), so no acknowledged sample waits for ever for others to fill its batch."""
        limit = self.ctl.config.lora.queued_tasks * (self.ctl.config.nodes - len(self.ctl.workers.dead))
        micro = self.ctl.config.lora.micro_batch
        while self.backlog and len(self.train_tasks) < limit:      # resumed samples first
            batch, self.backlog = self.backlog[:micro], self.backlog[micro:]
            self.submit_samples(self.store.get(batch))
        if not self.auto_train:
            return
        while len(self.train_tasks) < limit and (self.store.pending(self.cursor) >= micro or
                                                 (flush and self.store.pending(self.cursor) > 0)):
            samples, self.cursor = self.store.take(self.cursor, micro)
            self.submit_samples(samples)
        if 0 < self.store.pending(self.cursor) < micro and self._flush_timer is None:
            def flush() -> None:
                self._flush_timer = None
                self.pump_training(flush=True)
            self._flush_timer = asyncio.get_running_loop().call_later(self.ctl.config.lora.flush_after_s, flush)

    async def submit_training(self) -> Optional[int]:
        """Turn the next micro-batch of stored samples into a training task."""
        await self.ctl.workers.start()
        samples, self.cursor = self.store.take(self.cursor, self.ctl.config.lora.micro_batch)
        if not samples:
            return None
        return self.submit_samples(samples)[0]

    def submit_samples(self, samples: list) -> list[int]:
        """Stored samples become training tasks: one for the (prompt, completion) samples,
        one for the preference pairs (trained with the DPO loss), as there are."""
        tids = []
        for group in ([s for s in samples if not s.is_pair], [s for s in samples if s.is_pair]):
            if not group:
                continue
            tid = self.ctl.desk.new_id()
            ids = [s.ids() for s in group]
            rows, _ = training_rows([clip_sample(x, self.ctl.config.lora.max_len) for x in ids])
            task = OnlineTask(tid, TaskKind.TRAIN, self.ctl.driver.now(), max(len(p) + len(c) for p, c in rows), len(rows), 0)
            self.train_tasks[tid] = ids
            self.train_seqs[tid] = [s.seq for s in group]
            self.ctl.desk.register_task(task)
            self.ctl.driver.submit(task)
            tids.append(tid)
        return tids
