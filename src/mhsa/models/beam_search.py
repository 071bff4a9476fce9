"""Beam search for autoregressive decoders: keep the beam_size best prefixes of each
sequence, ranked by log-probability.

The decoder is a Decoder (mhsa.models.decoder): prefill(start, caches) takes the
prefixes, step(tokens, caches) one token per row, both returning next-token logits
(rows, vocab); caches.reorder(index) makes the caches follow the beams that survive
each step. A hypothesis ends at a stop token (mhsa.models.sampling's StopRule).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .decoder import Decoder
from .decoding import check_search
from .sampling import StopRule


@torch.no_grad()
def beam_search(
    decoder: Decoder,
    caches: object,
    start: Tensor,
    eos: int,
    max_new_tokens: int,
    beam_size: int = 4,
    length_penalty: float = 1.0,
) -> list[list[int]]:
    """Keep the beam_size best prefixes per sequence; return each sequence's best
    hypothesis (no prefix, no eos), ranked by log-prob / length**length_penalty among
    those that ended and the beams still alive at max_new_tokens.

    start (B, T0). The decoder and its caches must already serve B * beam_size rows,
    row b * beam_size + j being beam j of sequence b (e.g. the encoder output repeated
    beam_size times); all beams start equal, so the first step expands beam 0 only.
    """
    check_search(start, max_new_tokens)
    if beam_size <= 0:
        raise ValueError(f"beam_size must be positive, got {beam_size}")
    stop = StopRule((eos,), max_new_tokens)
    batch, k = start.shape[0], beam_size
    scores = torch.full((batch, k), -torch.inf)
    scores[:, 0] = 0.0
    beams: list[list[int]] = [[] for _ in range(batch * k)]  # tokens after the prefix
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    logits = decoder.prefill(start.repeat_interleave(k, dim=0), caches)
    for length in range(1, max_new_tokens + 1):
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        vocab = log_probs.shape[-1]
        candidates = (scores.unsqueeze(-1) + log_probs.view(batch, k, vocab)).view(batch, -1)
        top_scores, top_index = candidates.topk(2 * k, dim=-1)
        keep = torch.zeros(batch, k, dtype=torch.long)  # source row of each new beam
        next_tokens = torch.full((batch, k), eos, dtype=torch.long)
        for b in range(batch):
            alive = 0
            for score, index in zip(top_scores[b].tolist(), top_index[b].tolist(), strict=True):
                source, token = b * k + index // vocab, index % vocab
                if score == -torch.inf or alive == k:
                    break
                if stop.ends(token):
                    finished[b].append((score / length**length_penalty, beams[source]))
                    continue
                keep[b, alive], next_tokens[b, alive] = source, token
                scores[b, alive] = score
                alive += 1
            scores[b, alive:] = -torch.inf
            if _done(finished[b], scores[b], length, k, length_penalty):
                scores[b] = -torch.inf  # stop extending this sequence
        if (scores == -torch.inf).all():
            break
        index = keep.flatten()
        chosen = zip(index.tolist(), next_tokens.flatten().tolist(), strict=True)
        beams = [beams[i] + [token] for i, token in chosen]
        if stop.is_last(length - 1):  # the beams have max_new_tokens tokens
            break
        caches.reorder(index.to(start.device))
        logits = decoder.step(next_tokens.view(-1, 1).to(start.device), caches)
    results = []
    for b in range(batch):
        # beams still alive at max_new_tokens compete too, scored at their length (as
        # transformers, fairseq and CTranslate2 do); a sequence stopped early has none
        for j in range(k):
            if scores[b, j] > -torch.inf:
                tokens = beams[b * k + j]
                finished[b].append((scores[b, j].item() / len(tokens) ** length_penalty, tokens))
        results.append(max(finished[b], key=lambda item: item[0])[1])
    return results


def _done(finished: list, alive: Tensor, length: int, k: int, length_penalty: float) -> bool:
    """Stop once k hypotheses ended and the best live beam, normalised at its current
    length, scores no better than the worst of them. Exact without a length penalty
    (log-probs only fall as beams grow); with one, the usual heuristic, since dividing
    by a longer length can raise a live beam's normalised score."""
    if len(finished) < k:
        return False
    worst = sorted(score for score, _ in finished)[-k]
    return alive.max().item() / length**length_penalty <= worst
