"""The persistent input batch (vLLM v1's `InputBatch`): one row per scheduled request, kept across steps
and updated by diff, so a step copies only what changed since the last one.

Row i holds the i-th sequence the scheduler scheduled this step, so every per-step tensor is a prefix
view `[:B]` of a preallocated buffer:

- a request that joins the batch gets a row: its sampling parameters, block table and token ids are
  written once;
- a request that stays appends only the block ids its table grew by and the token ids it sampled since;
- a request that leaves (finished, preempted, or not scheduled this step) gives its row up, and the rows
  that stay move to their new places in one vectorized gather per array.

Compaction, not a free list, for the rows: attention reads `block_tables[B, W]` and `seq_lens[B]` as dense
rows in the batch's order, so scattered rows would need a gather into a dense copy every step. Rows
move only when the batch's membership or order changes (a request finishes or joins), never in steady
decode, and moving one is a few scalars and a block-table row. The token ids are the exception: a
request's ids (up to max_model_len of them) are read only through gathers, so they stay put in a
token slot taken from a free list, and the dense rows record each request's slot.

Rows are keyed by the request's Sequence object rather than its id string: a request id reused by a new
request is a new Sequence, so it cannot pick up the old one's row. A row also remembers its request's
preemption count: a request preempted since (its blocks were freed and reallocated) gets a fresh row
rather than a stale block table.

On CUDA the host buffers are pinned and each step's prefix is copied into device buffers whose addresses
never change (as CUDA graphs will need) with non-blocking copies; the runner synchronizes at the end of
every step, so the host side is not rewritten while a copy is in flight. On a CPU device the host tensor
is the device tensor and nothing is copied. The tensors a step hands out are views: valid until the next
`prepare`. A finished request's row (and its Sequence) is let go at the next `prepare`, not before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.executor.attention import AttentionMetadata
from inflight.executor.sampler import SamplingMetadata, sampling_row_values

if TYPE_CHECKING:
    from inflight.executor.scheduled import ScheduledSequence


class StagedBuffer:
    """A preallocated host array and the device tensor a step reads: pinned host memory and a device copy
    on CUDA (asynchronous host-to-device copies), one tensor on a CPU device."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n rows on the device."""
        if self.device is self.cpu:
            return self.cpu[:n]
        return self.device[:n].copy_(self.cpu[:n], non_blocking=True)


@dataclass
class BatchInputs:
    """One step's model inputs, in the scheduler's order of sequences."""

    input_ids: torch.Tensor  # [T] int64 on the device
    positions: torch.Tensor  # [T] int64 on the device
    attn_metadata: AttentionMetadata
    sample_rows: np.ndarray  # rows whose chunk reaches the end of their tokens: they sample this step
    # Draft tokens each of `sample_rows` verifies (its chunk ends with them); None when no row has any.
    num_spec_tokens: np.ndarray | None = None


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.device = device
        self.max_num_blocks_per_seq = -(-max_model_len // block_size)

        # Rows (dense, in batch order). Entries of a block-table row past its length are 0 and rows past
        # num_reqs are all 0, so a row can be moved or handed out without clearing its tail.
        self.block_table = StagedBuffer((max_num_seqs, self.max_num_blocks_per_seq), torch.int32, device)
        # Every per-row scalar is a row of one of two [fields, max_num_seqs] tables, so moving rows or
        # gathering the sampled ones is one fancy-indexing op per table, not one per field.
        self._int_fields = [
            "num_blocks_per_row",
            "num_tokens",  # ids written to the row's token slot
            "num_prompt_tokens",
            "token_slot",
            "num_preemptions",  # as of the row's creation
        ]
        self._sampling_ints = [k for k, dt in SamplingMetadata.ROW_FIELDS.items() if dt is np.int64]
        self._sampling_floats = [k for k, dt in SamplingMetadata.ROW_FIELDS.items() if dt is np.float64]
        self._ints = np.zeros((len(self._int_fields) + len(self._sampling_ints), max_num_seqs), dtype=np.int64)
        self._floats = np.zeros((len(self._sampling_floats), max_num_seqs), dtype=np.float64)
        self.num_blocks_per_row, self.num_tokens, self.num_prompt_tokens, self.token_slot, self.num_preemptions = (
            self._ints[: len(self._int_fields)]
        )
        self._seqs: list[ScheduledSequence] = []  # row -> request
        self._index: dict[ScheduledSequence, int] = {}  # request -> row (by identity)

        # Token slots (a free list; rows never move). np.zeros maps untouched pages lazily, so a large
        # max_model_len costs memory only for the ids requests actually hold.
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

        # Per-step, per-token and per-sequence buffers.
        self.input_ids = StagedBuffer((max_num_batched_tokens,), torch.int64, device)
        self.positions = StagedBuffer((max_num_batched_tokens,), torch.int64, device)
        self.slot_mapping = StagedBuffer((max_num_batched_tokens,), torch.int64, device)
        self.token_lora_slots = StagedBuffer((max_num_batched_tokens,), torch.int32, device)
        self.query_start_loc = StagedBuffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer((max_num_seqs,), torch.int32, device)
        self._arange = np.arange(max(max_num_seqs, max_num_batched_tokens) + 1, dtype=np.int64)

    @property
    def num_reqs(self) -> int:
        return len(self._seqs)

    # ---- the diff ------------------------------------------------------------------------------------

    def update(self, seqs: list[ScheduledSequence]) -> None:
        """Make rows 0..len(seqs)-1 hold `seqs`, in order, with their current block tables and token ids."""
        if len(seqs) > self.max_num_seqs:
            raise ValueError(f"{len(seqs)} sequences scheduled: the batch holds max_num_seqs={self.max_num_seqs}")
        preemptions = np.fromiter((s.num_preemptions for s in seqs), dtype=np.int64, count=len(seqs))
        if seqs != self._seqs:  # Sequence compares by identity: a C-speed check in steady decode
            self._update_rows(seqs, preemptions)
        else:
            # Same requests in the same rows; one may still have been preempted and resumed while the
            # runner did not run (a step that scheduled nothing): its blocks are new, so is its row.
            for i in np.nonzero(preemptions != self.num_preemptions[: len(seqs)])[0].tolist():
                self.block_table.np[i, : self.num_blocks_per_row[i]] = 0
                self._free_slots.append(int(self.token_slot[i]))
                self._add_row(i, seqs[i])
        self._append_tokens(seqs)  # first: it checks the lengths that bound the block tables too
        self._append_blocks(seqs)

    def _update_rows(self, seqs: list[ScheduledSequence], preemptions: np.ndarray) -> None:
        old_n, n = len(self._seqs), len(seqs)
        index = self._index
        src = np.fromiter((index.get(s, -1) for s in seqs), dtype=np.int64, count=n)  # -1: a fresh row
        was = src >= 0
        was[was] = self.num_preemptions[src[was]] == preemptions[was]
        src[~was] = -1
        kept = np.nonzero(was)[0]
        stays = np.zeros(old_n, dtype=bool)
        stays[src[kept]] = True
        self._free_slots.extend(self.token_slot[:old_n][~stays].tolist())

        table = self.block_table.np
        width = int(self.num_blocks_per_row[:old_n].max()) if old_n else 0  # old rows are 0 past this
        moved = kept[src[kept] != kept]
        if moved.size:
            # Fancy indexing reads every source row before it writes: overlapping moves are safe.
            table[moved, :width] = table[src[moved], :width]
            self._ints[:, moved] = self._ints[:, src[moved]]
            self._floats[:, moved] = self._floats[:, src[moved]]
        # Rows that no kept row landed on hold a departed request's blocks: clear them.
        landed = np.zeros(max(n, old_n), dtype=bool)
        landed[kept] = True
        table[np.nonzero(~landed[:old_n])[0], :width] = 0
        for i in np.nonzero(src < 0)[0].tolist():
            self._add_row(i, seqs[i])
        self._seqs = list(seqs)
        self._index = {s: i for i, s in enumerate(seqs)}

    def _add_row(self, row: int, seq: ScheduledSequence) -> None:
        # Its block table and token ids follow in the append passes (from length 0).
        self.num_blocks_per_row[row] = 0
        self.num_tokens[row] = 0
        self.num_prompt_tokens[row] = len(seq.prompt_token_ids)
        self.token_slot[row] = self._free_slots.pop()
        self.num_preemptions[row] = seq.num_preemptions
        values = sampling_row_values(seq.sampling_params, seq.seed)
        self._ints[len(self._int_fields) :, row] = [values[k] for k in self._sampling_ints]
        self._floats[:, row] = [values[k] for k in self._sampling_floats]

    def _append_blocks(self, seqs: list[ScheduledSequence]) -> None:
        n = len(seqs)
        lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        known = self.num_blocks_per_row[:n]
        changed = np.nonzero(lens != known)[0]
        if not changed.size:
            return
        table = self.block_table.np
        for i in changed.tolist():
            blocks = seqs[i].block_table
            start, end = int(known[i]), len(blocks)
            if end < start:  # tables only grow while a request runs; rewrite rather than trust a shrunk one
                table[i, end:start] = 0
                start = 0
            table[i, start:end] = blocks[start:]
        known[changed] = lens[changed]

    def _append_tokens(self, seqs: list[ScheduledSequence]) -> None:
        n = len(seqs)
        totals = np.fromiter((len(s.prompt_token_ids) + len(s.output_token_ids) for s in seqs), np.int64, count=n)
        known = self.num_tokens[:n]
        grew = totals - known
        changed = grew != 0
        if not changed.any():
            return
        if totals.max() > self.max_model_len:
            raise ValueError(f"a sequence of {totals.max()} tokens: the batch holds max_model_len={self.max_model_len}")
        # Decode: exactly the token sampled last step, an output token; written in one scatter.
        one = np.nonzero((grew == 1) & (known >= self.num_prompt_tokens[:n]))[0]
        if one.size:
            last = np.fromiter((seqs[i].output_token_ids[-1] for i in one.tolist()), np.int32, count=one.size)
            self.token_ids[self.token_slot[one], known[one]] = last
            changed[one] = False
        for i in np.nonzero(changed)[0].tolist():
            s = seqs[i]
            start = int(known[i]) if grew[i] > 0 else 0  # outputs only grow; rewrite a shrunk list
            row = self.token_ids[self.token_slot[i]]
            p = len(s.prompt_token_ids)
            if start < p:
                row[start:p] = s.prompt_token_ids[start:]
            row[max(start, p) : int(totals[i])] = s.output_token_ids[max(start - p, 0) :]
        known[:] = totals

    # ---- one step's inputs ---------------------------------------------------------------------------

    def prepare(
        self,
        seqs: list[ScheduledSequence],
        num_scheduled_tokens: list[int],
        spec_token_ids: list[list[int]] | None = None,
        lora_slots: list[int] | None = None,
    ) -> BatchInputs:
        """Update the rows by diff, then build the step's flattened inputs from them. `spec_token_ids`: each
        sequence's draft tokens, scheduled after its own tokens (they go in the row's token slot past its
        tokens, where the next real tokens overwrite them). `lora_slots`: each sequence's adapter slot (-1: none)."""
        self.update(seqs)
        b = len(seqs)
        num_spec = None
        if spec_token_ids is not None:
            num_spec = np.fromiter((len(d) for d in spec_token_ids), dtype=np.int64, count=b)
            for i in np.nonzero(num_spec)[0].tolist():
                start = int(self.num_tokens[i])
                self.token_ids[self.token_slot[i], start : start + num_spec[i]] = spec_token_ids[i]
        n = np.asarray(num_scheduled_tokens, dtype=np.int64)
        num_computed = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=b)
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        total = int(qsl[-1])
        if total > self.max_num_batched_tokens:
            raise ValueError(
                f"{total} tokens scheduled: the batch holds max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        seq_lens = num_computed + n
        num_blocks = self.num_blocks_per_row[:b]
        # A short table would map tokens into the padding's block 0, which may be another request's cached
        # prefix: check coverage once per step on the host (no per-layer skip test, which would sync a GPU).
        assert (-(-seq_lens // self.block_size) <= num_blocks).all(), "a block table does not cover its tokens"

        positions = self.positions.np[:total]
        if total == b:  # decode only: one token per row, at its computed count
            token_rows = self._arange[:b]
            positions[:] = num_computed
        else:
            token_rows = np.repeat(self._arange[:b], n)
            # Position of every token: its sequence's computed count plus its offset inside the chunk.
            np.add(self._arange[:total], np.repeat(num_computed - qsl[:-1], n), out=positions)
        flat = self.token_slot[token_rows] * self.max_model_len + positions
        self.input_ids.np[:total] = self.token_ids.reshape(-1)[flat]
        slots = self.slot_mapping.np[:total]
        blocks = self.block_table.np[token_rows, positions // self.block_size]
        np.multiply(blocks, self.block_size, out=slots, dtype=np.int64)
        slots += positions % self.block_size
        self.query_start_loc.np[: b + 1] = qsl
        self.seq_lens.np[:b] = seq_lens

        width = int(num_blocks.max())
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.to_device(total),
            query_start_loc=self.query_start_loc.to_device(b + 1),
            seq_lens=self.seq_lens.to_device(b),
            block_tables=self.block_table.to_device(b)[:, :width],
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
        )
        if lora_slots is not None:
            self.token_lora_slots.np[:total] = np.repeat(np.asarray(lora_slots, dtype=np.int32), n)
            meta.token_lora_slots = self.token_lora_slots.to_device(total)
        # Chunks that reach the end (past their drafts) sample a token.
        ends = self.num_tokens[:b] if num_spec is None else self.num_tokens[:b] + num_spec
        sample_rows = np.nonzero(seq_lens == ends)[0]
        spec = num_spec[sample_rows] if num_spec is not None else None
        return BatchInputs(self.input_ids.to_device(total), self.positions.to_device(total), meta, sample_rows, spec)

    def sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """The sampling parameters and token ids of `rows` (in that order), from the batch's arrays. A row may
        repeat: `offsets` (per entry) then moves its output index past that many of its draft tokens, which
        sit in its token slot after its tokens (verification samples every draft position)."""
        ints, floats = self._ints[:, rows], self._floats[:, rows]
        field = self._int_fields.index
        num_tokens, num_prompt, slots = (
            ints[field("num_tokens")],
            ints[field("num_prompt_tokens")],
            ints[field("token_slot")],
        )
        return SamplingMetadata(
            **dict(zip(self._sampling_ints, ints[len(self._int_fields) :])),
            **dict(zip(self._sampling_floats, floats)),
            output_lens=num_tokens - num_prompt + (0 if offsets is None else offsets),
            num_prompt_tokens=num_prompt,
            token_ids=self.token_ids,
            token_rows=slots,
        )
