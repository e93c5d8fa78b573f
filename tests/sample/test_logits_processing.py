"""Penalties, logit_bias, allowed_token_ids, bad_words and min_tokens, each against a plain
numpy/Python formula on crafted logits, through the worker's persistent batch (its SamplingBatch
reads each row's tokens from the InputBatch) and the Sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.sample.logits_processors import banned_bad_words
from minivllm.sample.sampler import Sampler
from minivllm.sampling_params import SamplingParams
from minivllm.worker.input_batch import CachedRequestState, InputBatch
from minivllm.worker.sampling_batch import SamplingBatch

VOCAB = 12
EOS = 11


def make_input_batch(rows: list[tuple[SamplingParams, list[int], list[int]]]) -> InputBatch:
    """rows: (params, prompt ids, output ids so far); request i gets id str(i)."""
    batch = InputBatch(max_num_reqs=8, max_model_len=32, max_num_batched_tokens=32, block_sizes=[4],
                       vocab_size=VOCAB, device=torch.device("cpu"))
    for i, (params, prompt, output) in enumerate(rows):
        batch.add_request(CachedRequestState(str(i), prompt, params, EOS, None, ([],), 0, list(output)))
    return batch


def make_batch(rows: list[tuple[SamplingParams, list[int], list[int]]]) -> SamplingBatch:
    return make_input_batch(rows).sampling


def processed(batch: SamplingBatch, logits: np.ndarray, rows: list[int]) -> np.ndarray:
    metadata = batch.make_metadata(np.array(rows))
    return Sampler.process_logits(torch.from_numpy(logits.copy()), metadata).numpy()


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.copy()
    counts = np.bincount(np.array(output, dtype=int), minlength=VOCAB) if output else np.zeros(VOCAB)
    for t in range(VOCAB):
        if t in prompt or counts[t] > 0:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= freq * counts[t] + pres * (counts[t] > 0)
    return out


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(4, VOCAB)).astype(np.float32) * 3


def test_penalties_match_formula(logits):
    cases = [
        (SamplingParams(repetition_penalty=1.7), [1, 2, 3], [3, 4, 4]),
        (SamplingParams(frequency_penalty=0.8), [5], [0, 0, 0, 7]),
        (SamplingParams(presence_penalty=-1.5, repetition_penalty=0.6), [9, 9], [2, 8, 2]),
        (SamplingParams(), [1], [1, 1]),  # no penalty: untouched
    ]
    batch = make_batch(cases)
    out = processed(batch, logits, [0, 1, 2, 3])
    for i, (p, prompt, output) in enumerate(cases):
        expected = reference_penalties(
            logits[i], prompt, output, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        )
        np.testing.assert_allclose(out[i], expected, rtol=1e-6, err_msg=f"row {i}")


def test_output_counts_follow_sampled_tokens_and_row_moves(logits):
    """Counts are updated incrementally, several tokens per step too; a row moved by a removal
    keeps its counts and its tokens."""
    p = SamplingParams(frequency_penalty=1.0)
    batch = make_input_batch([(SamplingParams(), [1], []), (p, [2], [])])
    batch.append_sampled_token_ids(np.array([1, 0]), [[4, 4], [9]])
    batch.append_sampled_token_ids(np.array([1]), [[6]])
    batch.remove_request("0")  # request "1" moves to row 0
    assert batch.output_token_ids(0) == [4, 4, 6]
    out = processed(batch.sampling, logits, [0])
    np.testing.assert_allclose(out[0], reference_penalties(logits[0], [2], [4, 4, 6], 1.0, 1.0, 0.0), rtol=1e-6)


def test_resumed_request_counts_its_earlier_output(logits):
    batch = make_batch([(SamplingParams(presence_penalty=2.0), [0], [3, 3, 5])])
    out = processed(batch, logits, [0])
    np.testing.assert_allclose(out[0], reference_penalties(logits[0], [0], [3, 3, 5], 1.0, 0.0, 2.0), rtol=1e-6)


def test_logit_bias_allowed_and_rows_selected(logits):
    cases = [
        (SamplingParams(logit_bias={3: 5.0, 7: -2.5}), [0], []),
        (SamplingParams(allowed_token_ids=[2, 9]), [0], []),
        (SamplingParams(), [0], []),
    ]
    batch = make_batch(cases)
    # Sample rows 2 and 0 only, in that order.
    out = processed(batch, logits[[2, 0]], [2, 0])
    np.testing.assert_array_equal(out[0], logits[2])
    expected = logits[0].copy()
    expected[3] += 5.0
    expected[7] -= 2.5
    np.testing.assert_allclose(out[1], expected, rtol=1e-6)
    out = processed(batch, logits[:2], [0, 1])
    assert set(np.flatnonzero(np.isfinite(out[1]))) == {2, 9}
    np.testing.assert_array_equal(out[1][[2, 9]], logits[1][[2, 9]])


def test_min_tokens_bans_eos_and_stop_ids_until_reached(logits):
    cases = [
        (SamplingParams(min_tokens=3, stop_token_ids=[4]), [0], [1, 2]),  # 2 < 3: banned
        (SamplingParams(min_tokens=2, stop_token_ids=[4]), [0], [1, 2]),  # reached: free
        (SamplingParams(min_tokens=5, ignore_eos=True), [0], []),  # EOS ignored: not banned
    ]
    out = processed(make_batch(cases), logits[:3], [0, 1, 2])
    assert np.isneginf(out[0][[4, EOS]]).all() and np.isfinite(np.delete(out[0], [4, EOS])).all()
    np.testing.assert_array_equal(out[1], logits[1])
    np.testing.assert_array_equal(out[2], logits[2])


@pytest.mark.parametrize(
    ("output", "words", "expected"),
    [
        ([5, 6], [[7]], [7]),  # one-token word: always banned
        ([5, 6], [[6, 8]], [8]),  # output ends with the word's prefix
        ([5, 6], [[5, 8]], []),  # prefix present but not at the end
        ([6], [[5, 6, 9]], []),  # longer than the output
        ([5, 6], [[5, 6, 9], [1]], [9, 1]),
    ],
)
def test_banned_bad_words(output, words, expected):
    assert banned_bad_words(output, words) == expected


def test_bad_words_through_batch(logits):
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[[7], [3, 8]])
    out = processed(make_batch([(params, [0], [1, 3])]), logits[:1], [0])
    assert np.isneginf(out[0][[7, 8]]).all()
    assert np.isfinite(np.delete(out[0], [7, 8])).all()


def test_greedy_rows_see_processed_logits(logits):
    """Greedy takes the argmax after the processors (vLLM's order), not before."""
    top = int(logits[0].argmax())
    params = SamplingParams(temperature=0.0, logit_bias={top: -100.0})
    batch = make_batch([(params, [0], [])])
    metadata = batch.make_metadata(np.array([0]))
    sampled = Sampler()(torch.from_numpy(logits[:1].copy()), metadata).sampled_token_ids
    masked = logits[0].copy()
    masked[top] -= 100
    assert int(sampled[0]) == int(masked.argmax()) != top
