"""Batched sampling: penalties, min_tokens, temperature, top-k / top-p / min-p and seeded Gumbel-max.

Batch invariance: a row's token depends only on its logits row, its params, its seed and its output
index. The random part is Gumbel noise hashed from (seed, output index, vocab id) (sampling_noise.py), so
no RNG state is shared between rows or steps, and the same token gets the same noise whether a row is
sampled over the whole vocabulary or over a top-k window of it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from inflight.executor.sampling_noise import gumbel_argmax, gumbel_noise, id_hashes, row_keys
from inflight.ops import cpu as cpu_ops
from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.executor.scheduled import ScheduledSequence

# Below this a temperature is treated as greedy: logits / 1e-6 would overflow float32 softmax maths.
_MIN_TEMPERATURE = 1e-5
# Rows with top-k/top-p/min-p are sampled from a sorted window of their best tokens (the first window of
# a top-p/min-p row holds _WINDOW), widened at least this much until the allowed set provably fits.
_WINDOW = 64
_WIDEN = 4


def _greedy(work: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; fp32 rows on a CPU go through our vectorized op (the same answer as torch's)."""
    if work.device.type == "cpu" and work.dtype == torch.float32 and work.stride(-1) == 1 and cpu_ops.available():
        return cpu_ops.argmax(work)
    return work.argmax(-1)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, sampled token under log_softmax(raw logits)
    top_ids: torch.Tensor | None  # [B, N] int64, N = max logprobs asked in the batch
    top_logprobs: torch.Tensor | None  # [B, N] float32


def sampling_row_values(params: SamplingParams, seed: int) -> dict[str, float | int]:
    """One request's entries in SamplingMetadata's per-row arrays."""
    top_k = params.top_k if params.top_k > 0 else 0
    return {
        "temperature": params.temperature,
        "top_k": min(top_k, 2**31 - 1),  # any k at or past the vocabulary is "off" for the sampler
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "min_tokens": params.min_tokens,
        "logprobs": -1 if params.logprobs is None else params.logprobs,
        "seeds": seed,
        "num_logit_bias": len(params.logit_bias or ()),
    }


@dataclass
class SamplingMetadata:
    """The sampled rows' parameters as arrays ([S], in the logits' row order) and where their token ids live.

    The persistent input batch builds it from its rows (no per-step Python lists); `from_seqs` builds it
    from sequences. Floats are kept in float64, the parameters' own values, and cast where they are used,
    as `torch.tensor(list_of_floats, dtype=...)` did."""

    # name -> dtype of the per-row parameter arrays (the input batch keeps one array per name)
    ROW_FIELDS: ClassVar[dict[str, type]] = {
        "temperature": np.float64,
        "top_k": np.int64,  # 0: off
        "top_p": np.float64,
        "min_p": np.float64,
        "repetition_penalty": np.float64,
        "presence_penalty": np.float64,
        "frequency_penalty": np.float64,
        "min_tokens": np.int64,
        "logprobs": np.int64,  # -1: none asked
        "seeds": np.int64,
        "num_logit_bias": np.int64,  # entries of the row's logit_bias
    }

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    min_tokens: np.ndarray
    logprobs: np.ndarray
    seeds: np.ndarray
    num_logit_bias: np.ndarray
    output_lens: np.ndarray  # int64: outputs so far, which is the output index this step samples
    num_prompt_tokens: np.ndarray  # int64
    token_ids: np.ndarray  # [R, L] integer table: row token_rows[i] holds row i's prompt ids, then its outputs
    token_rows: np.ndarray  # int64 [S]

    @classmethod
    def from_seqs(cls, seqs: list[ScheduledSequence]) -> SamplingMetadata:
        rows = [sampling_row_values(s.sampling_params, s.seed) for s in seqs]
        width = max((s.num_tokens for s in seqs), default=0)
        token_ids = np.zeros((len(seqs), width), dtype=np.int64)
        for row, s in zip(token_ids, seqs):
            row[: s.num_tokens] = s.prompt_token_ids + s.output_token_ids
        return cls(
            **{name: np.array([r[name] for r in rows], dtype=dt) for name, dt in cls.ROW_FIELDS.items()},
            output_lens=np.array([len(s.output_token_ids) for s in seqs], dtype=np.int64),
            num_prompt_tokens=np.array([len(s.prompt_token_ids) for s in seqs], dtype=np.int64),
            token_ids=token_ids,
            token_rows=np.arange(len(seqs), dtype=np.int64),
        )

    def select(self, idx: np.ndarray) -> SamplingMetadata:
        """The rows `idx`, in that order."""
        return SamplingMetadata(
            **{name: getattr(self, name)[idx] for name in (*self.ROW_FIELDS, "output_lens", "num_prompt_tokens")},
            token_ids=self.token_ids,
            token_rows=self.token_rows[idx],
        )

    def token_ids_of(self, rows: np.ndarray, start: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """ids [start, start + len) of each of `rows`, concatenated: one gather, no per-row Python."""
        first = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(lens[:-1], out=first[1:])
        base = self.token_rows[rows] * self.token_ids.shape[1] + start - first
        return self.token_ids.reshape(-1)[np.repeat(base, lens) + np.arange(int(lens.sum()), dtype=np.int64)]


def _rows(idx: np.ndarray | list[int], n: int, device: torch.device) -> slice | torch.Tensor:
    """Index selecting `idx` out of n rows; a plain slice (a view, no copy) when it is all of them."""
    return slice(None) if len(idx) == n else torch.as_tensor(idx, dtype=torch.int64).to(device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _next_pow2_np(n: np.ndarray) -> np.ndarray:
    # frexp's exponent of n - 1 > 0 is its bit length (exact below 2**53); 1 for n <= 1, as _next_pow2.
    return np.left_shift(1, np.frexp(np.maximum(n - 1, 0).astype(np.float64))[1].astype(np.int64))


def _top_k_on(md: SamplingMetadata, vocab: int) -> np.ndarray:
    """Each row's top-k, 0 where it keeps every token."""
    return np.where((md.top_k > 0) & (md.top_k < vocab), md.top_k, 0)


class Sampler:
    """Turns a step's logits [B, V] into one token per sequence. Ids >= vocab_size (padding columns of
    the model's vocabulary) are never sampled. A temperature below 1e-5 is greedy; penalties and the
    min_tokens mask apply to greedy rows too."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._id_hash_cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[ScheduledSequence],
        grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
        metadata: SamplingMetadata | None = None,
        in_place: bool = False,
    ) -> SamplerOutput:
        """`logits` is left unmodified and penalties and masks work on a copy, unless `in_place` (the engine's
        logits of one step, used once): then they go into `logits`, raw logprobs taken first. `grammar_bitmask` is
        (bitmask [B, ceil(V/32)] int32, rows [R]): the structured-output rows and their masks (a set bit
        allows a token); the other rows of the bitmask are ignored. `metadata` holds `seqs`' parameters
        and token ids as arrays (the engine passes the input batch's); without it they are read from `seqs`."""
        md = metadata if metadata is not None else SamplingMetadata.from_seqs(seqs)
        num_rows = len(seqs)
        vocab = min(self.vocab_size, logits.shape[1])

        raw = self._raw_logprobs(logits, md)
        pristine = logits[:, :vocab]  # where a grammar row whose allowed tokens min_tokens masked starts again
        if in_place and grammar_bitmask is not None:
            pristine = pristine.clone()
        work = self.penalize(logits[:, :vocab], seqs, md, in_place)
        if grammar_bitmask is not None:
            work = self._apply_grammar(pristine, work, *grammar_bitmask)
        is_sampled = md.temperature >= _MIN_TEMPERATURE
        sampled = np.nonzero(is_sampled)[0]
        if not sampled.size:
            token_ids = _greedy(work)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
            if len(sampled) < num_rows:
                g = _rows(np.nonzero(~is_sampled)[0], num_rows, logits.device)
                token_ids[g] = _greedy(work[g])
            s = _rows(sampled, num_rows, logits.device)
            token_ids[s] = self._sample(work[s], md.select(sampled))
        return self._logprobs(raw, token_ids, md, SamplerOutput(token_ids, None, None, None))

    # -- logits processors (before temperature) -------------------------------------------------------

    def penalize(
        self,
        work: torch.Tensor,
        seqs: list[ScheduledSequence],
        metadata: SamplingMetadata | None = None,
        in_place=False,
    ) -> torch.Tensor:
        """logit_bias, repetition / presence / frequency penalties and the min_tokens mask (greedy rows too, as
        in vLLM and HF). Returns `work` itself when no row needs either, else a modified copy (`work` itself,
        modified, when `in_place`)."""
        md = metadata if metadata is not None else SamplingMetadata.from_seqs(seqs)
        vocab = work.shape[1]
        penalized = np.nonzero(
            (md.repetition_penalty != 1.0) | (md.presence_penalty != 0.0) | (md.frequency_penalty != 0.0)
        )[0]
        masked_rows, masked_ids = [], []
        biased_rows, biased_ids, biases = [], [], []
        for i in np.nonzero(md.num_logit_bias)[0].tolist():
            for t, b in seqs[i].sampling_params.logit_bias.items():
                if t < vocab:
                    biased_rows.append(i), biased_ids.append(t), biases.append(b)
        for i in np.nonzero(md.output_lens < md.min_tokens)[0].tolist():
            ids = [t for t in itertools.chain(self.eos_token_ids, seqs[i].sampling_params.stop_token_ids) if t < vocab]
            masked_rows.extend([i] * len(ids))
            masked_ids.extend(ids)
        if not (penalized.size or masked_rows or biased_rows):
            return work
        if not in_place:
            work = work.clone()
        if biased_rows:  # OpenAI's logit_bias: added to the model's logits, before penalties and masks
            rows = torch.tensor(biased_rows, dtype=torch.int64, device=work.device)
            ids = torch.tensor(biased_ids, dtype=torch.int64, device=work.device)
            work.index_put_((rows, ids), torch.tensor(biases, dtype=work.dtype, device=work.device), accumulate=True)
        if penalized.size:
            self._apply_penalties_(work, penalized, md)
        if masked_rows:
            rows = torch.tensor(masked_rows, dtype=torch.int64, device=work.device)
            work[rows, torch.tensor(masked_ids, dtype=torch.int64, device=work.device)] = -math.inf
        return work

    @staticmethod
    def _apply_grammar(
        logits: torch.Tensor, work: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Disallowed tokens of the constrained rows to -inf, in one vectorized pass; other rows untouched."""
        import xgrammar as xgr  # only batches with a constrained row pay for the import

        if work.data_ptr() == logits.data_ptr():
            work = work.clone()
        vocab = work.shape[1]
        bitmask = bitmask.to(work.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(work, bitmask, vocab_size=vocab, indices=rows.tolist())
        # min_tokens may have masked the only tokens the grammar allows (its stop tokens once it can
        # only end): the grammar wins, or the row would have nothing left to sample.
        dead = rows[torch.isneginf(work[rows.to(work.device)].amax(-1)).cpu()]
        if dead.numel():
            d = dead.to(work.device)
            work[d] = logits[d]
            xgr.apply_token_bitmask_inplace(work, bitmask, vocab_size=vocab, indices=dead.tolist())
        return work

    def _apply_penalties_(self, work: torch.Tensor, rows: np.ndarray, md: SamplingMetadata) -> None:
        # Only the tokens a sequence has seen are touched: index ops over those, not passes over [B, V].
        vocab = work.shape[1]
        num_prompt, num_output = md.num_prompt_tokens[rows], md.output_lens[rows]
        ids = md.token_ids_of(rows, num_prompt, num_output)
        lens = num_output
        with_prompt = bool((md.repetition_penalty[rows] != 1.0).any())
        if with_prompt:  # output ids of every row, then prompt ids
            ids = np.concatenate([ids, md.token_ids_of(rows, np.zeros_like(num_prompt), num_prompt)])
            lens = np.concatenate([num_output, num_prompt])
        copies = 2 if with_prompt else 1
        # Per id: its row (of `rows`), its offset in the flattened logits, and its row's penalties.
        id_rows = np.repeat(np.tile(np.arange(len(rows)), copies), lens)
        pos = rows[id_rows] * vocab + ids
        values = np.stack([md.repetition_penalty[rows], md.presence_penalty[rows], md.frequency_penalty[rows]], 1)
        values = torch.from_numpy(values).to(work.dtype)[torch.from_numpy(id_rows)]
        num_out = int(num_output.sum())
        if ids.size and int(ids.max()) >= vocab:  # ids past the sampled vocabulary have no logit
            keep = ids < vocab
            num_out = int(keep[:num_out].sum())
            pos, values = pos[keep], values[torch.from_numpy(keep)]
        pos = torch.from_numpy(pos).to(work.device, non_blocking=True)
        rep, pres, freq = values.to(work.device).unbind(1)

        flat = work.view(-1)
        # Duplicate positions write the same value, so plain (non-accumulating) index writes are exact.
        if with_prompt:
            # vLLM/HF: a token seen in the prompt or the output is made less likely whatever its sign.
            seen = flat.index_select(0, pos)
            flat.index_copy_(0, pos, torch.where(seen > 0, seen / rep, seen * rep))  # rep == 1: unchanged
        # OpenAI: subtract presence once per distinct output token and frequency once per occurrence.
        out = pos[:num_out]
        flat.index_copy_(0, out, flat.index_select(0, out) - pres[:num_out])
        flat.index_add_(0, out, -freq[:num_out])

    # -- sampling -------------------------------------------------------------------------------------

    def _hashed_vocab(self, vocab: int, device: torch.device) -> torch.Tensor:
        key = (vocab, device)
        if key not in self._id_hash_cache:
            self._id_hash_cache[key] = id_hashes(torch.arange(vocab, device=device))
        return self._id_hash_cache[key]

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        n, vocab = logits.shape
        dev = logits.device
        temps = torch.from_numpy(md.temperature).to(dev, torch.float32)
        keys = row_keys(torch.from_numpy(md.seeds).to(dev), torch.from_numpy(md.output_lens).to(dev))
        hashed = self._hashed_vocab(vocab, dev)
        token_ids = torch.empty(n, dtype=torch.int64, device=dev)

        top_k = _top_k_on(md, vocab)
        # One past k so that a tie at the k-th value is seen inside the window.
        sizes = np.where(top_k > 0, np.minimum(vocab, np.maximum(16, _next_pow2_np(top_k + 1))), 0)
        sizes[(top_k == 0) & ((md.top_p < 1.0) | (md.min_p > 0.0))] = min(vocab, _WINDOW)
        plain = np.nonzero(sizes == 0)[0].tolist()
        windowed = np.nonzero(sizes)[0]
        windows: dict[int, list[int]] = {}
        _, first = np.unique(sizes[windowed], return_index=True)
        for size in sizes[windowed[np.sort(first)]].tolist():  # in order of first appearance
            windows[size] = np.nonzero(sizes == size)[0].tolist()
        if plain:
            r = _rows(plain, n, dev)
            token_ids[r] = gumbel_argmax(logits[r], temps[r], keys[r], hashed)
        # The windows and floors work on the scaled logits; plain rows scale as they are sampled.
        scaled = logits.float() / temps[:, None] if windows else None
        # The window size of a row depends only on its params and its own logits: batch invariant.
        floor_rows, floors = [], []
        while windows:
            size, idx = windows.popitem()
            r = _rows(idx, n, dev)
            picked, wider, floored = self._sample_window(scaled[r], keys[r], hashed, md.select(np.array(idx)), size)
            token_ids[r] = picked
            for j, new_size in wider:
                windows.setdefault(new_size, []).append(idx[j])
            if floored is not None:
                floor_rows += [idx[j] for j in floored[0].tolist()]
                floors.append(floored[1])
        if floor_rows:
            r = _rows(floor_rows, n, dev)
            token_ids[r] = gumbel_argmax(logits[r], temps[r], keys[r], hashed, torch.cat(floors))
        return token_ids

    def _sample_window(
        self,
        scaled: torch.Tensor,
        keys: torch.Tensor,
        hashed: torch.Tensor,
        md: SamplingMetadata,
        size: int,
    ) -> tuple[torch.Tensor, list[tuple[int, int]], tuple[torch.Tensor, torch.Tensor] | None]:
        """Sample rows from their `size` best tokens. For the rows whose allowed set may not fit in the
        window, which must be sampled again, also returns (row, wider size) pairs, and (rows, floors) for
        those better sampled over the whole vocabulary among the tokens >= their floor."""
        n, vocab = scaled.shape
        dev = scaled.device
        vals, ids = scaled.topk(size, dim=-1)  # sorted, best first
        top_k_np = _top_k_on(md, vocab)
        top_k = torch.from_numpy(top_k_np).to(dev)
        top_p = torch.from_numpy(md.top_p).to(dev, vals.dtype)
        min_p = torch.from_numpy(md.min_p).to(dev, vals.dtype)
        has_k = top_k > 0

        # Thresholds are logit values, so tied tokens are all in or all out whatever order topk gave.
        neg_inf = torch.full((n,), -math.inf, dtype=vals.dtype, device=dev)
        thr_k = torch.where(has_k, vals.gather(1, (top_k - 1).clamp(min=0)[:, None])[:, 0], neg_inf)
        best = vals[:, :1]
        probs = torch.exp(vals - best).masked_fill_(vals < thr_k[:, None], 0.0)  # unnormalized
        cum = probs.cumsum(-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        # top-p's mass is over the top-k set, else over the whole row (which may extend past the window).
        if ((md.top_p < 1.0) & (top_k_np == 0)).any():
            total = torch.where(has_k, cum[:, -1], torch.exp(scaled - best).sum(-1))
        else:
            total = cum[:, -1]
        keep = before < torch.where(top_p < 1.0, top_p * total, torch.full_like(total, math.inf))[:, None]
        # The best token always stays: a top_p that is 0 in float32 (1e-300) would otherwise keep nothing.
        thr_p = vals.gather(1, (keep.sum(-1) - 1).clamp(min=0)[:, None])[:, 0]
        thr_min = best[:, 0] + torch.log(min_p)  # p >= min_p * p_max, in logit space
        thr = torch.maximum(torch.maximum(thr_k, thr_p), thr_min)

        score = (vals + gumbel_noise(keys, hashed[ids])).masked_fill_(vals < thr[:, None], -math.inf)
        picked = ids.gather(1, score.argmax(-1, keepdim=True))[:, 0]
        if size == vocab:
            return picked, [], None
        last = vals[:, -1]
        overflow = ((last >= torch.where(has_k, thr_k, thr)) & (last > -math.inf)).nonzero()[:, 0]
        if overflow.numel() == 0:
            return picked, [], None
        # Every allowed token is >= max(k-th value, min-p threshold): counting those sizes the next
        # window exactly; a top-p set is guessed from the window's share of the mass instead.
        bound = torch.maximum(thr_k, thr_min)[overflow]
        need = (size * 1.25 * top_p * total / cum[:, -1])[overflow].clamp(max=vocab).long()
        overflow_np = overflow.cpu().numpy()
        bounded = (md.min_p[overflow_np] > 0) | (top_k_np[overflow_np] > 0)
        if bounded.any():
            b = torch.from_numpy(bounded).to(dev)
            count = (scaled[overflow[b]] >= bound[b, None]).sum(-1) + 1
            open_p = ((top_p < 1.0) & ~has_k)[overflow[b]]
            need[b] = torch.where(open_p, torch.minimum(need[b], count), count)
        # Without top-p the bound is the allowed set: past a few hundred tokens a masked pass over the
        # vocabulary is cheaper than sorting them.
        floored = ((top_p >= 1.0)[overflow] & (need > max(_WINDOW, vocab // 64))).tolist()
        wider = []
        for j, m, f in zip(overflow.tolist(), need.tolist(), floored):
            if not f:
                wider.append((j, min(vocab, max(_WIDEN * size, _next_pow2(m)))))
        f = torch.tensor(floored, device=dev)
        return picked, wider, (overflow[f], bound[f]) if any(floored) else None

    # -- logprobs -------------------------------------------------------------------------------------

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
        """Log-softmax of the model's logits, before any penalty or mask (vLLM's raw_logprobs), if a row asks."""
        if not (md.logprobs >= 0).any():
            return None
        return torch.log_softmax(logits.to(torch.float32), dim=-1)

    def _logprobs(
        self, raw: torch.Tensor | None, token_ids: torch.Tensor, md: SamplingMetadata, out: SamplerOutput
    ) -> SamplerOutput:
        if raw is None:  # no row asked (_raw_logprobs)
            return out
        out.logprobs = raw.gather(1, token_ids[:, None])[:, 0]
        top_n = int(md.logprobs.max())
        if top_n > 0:
            out.top_logprobs, out.top_ids = raw.topk(top_n, dim=-1)
        return out
