"""Choosing the next token (hexq.runtime.sampling.next_token) and streaming text around stop strings and unfinished
characters (TextStream), shared by hexq run and hexq serve."""

from __future__ import annotations

import pytest
import torch

from hexq.runtime.sampling import Sampling, TextStream, _nucleus, next_token


def test_greedy_takes_the_argmax_and_ignores_the_generator():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, Sampling(), torch.Generator().manual_seed(1)) == 1


def test_nucleus_keeps_the_smallest_set_reaching_top_p_and_the_top_k():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    assert _nucleus(probs, 0, 0.5).nonzero().flatten().tolist() == [1]  # 0.5 alone reaches 0.5
    assert _nucleus(probs, 0, 0.51).nonzero().flatten().tolist() == [1, 2]
    assert _nucleus(probs, 0, 0.95).nonzero().flatten().tolist() == [1, 2, 3]
    assert _nucleus(probs, 2, 1.0).nonzero().flatten().tolist() == [1, 2]
    assert _nucleus(probs, 0, 1e-6).nonzero().flatten().tolist() == [1]  # the most likely token always stays
    assert torch.equal(_nucleus(probs, 0, 1.0), probs)


def test_sampling_draws_only_from_the_kept_tokens_and_repeats_with_its_seed():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    sampling = Sampling(temperature=1.0, top_p=0.75, seed=3)
    generator = sampling.generator()
    draws = [next_token(logits, sampling, generator) for _ in range(400)]
    assert set(draws) == {1, 2}
    again = sampling.generator()
    assert draws[:20] == [next_token(logits, sampling, again) for _ in range(20)]
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    other = Sampling(temperature=1.0, top_p=0.75, seed=4).generator()  # another seed, other draws
    assert draws[:40] != [next_token(logits, sampling, other) for _ in range(40)]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_the_draws_follow_the_softmax_at_the_temperature(temperature):
    """Token frequencies over 4000 draws (a fixed seed: the same counts every run) within 0.03 of softmax(logits / T);
    T = 0.5 and 2 put token 1 at 0.68 and 0.38, against 0.5 at T = 1."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    sampling = Sampling(temperature=temperature, seed=0)
    generator = sampling.generator()
    counts = torch.bincount(torch.tensor([next_token(logits, sampling, generator) for _ in range(4000)]),
                            minlength=4)
    assert torch.allclose(counts / 4000, torch.softmax(logits / temperature, -1), atol=0.03)


class Letters:
    """A tokenizer whose tokens are characters; token 0 is the end of sequence, 1 a half character (U+FFFD until
    token 2 finishes it as 'é')."""

    eos_token_id = 0

    def decode(self, tokens, skip_special_tokens=False):
        out, pending = [], False
        for t in tokens:
            if t == 1:
                pending = True
            elif t == 2 and pending:
                out.append("é")
                pending = False
            elif t not in (1, 2) and not (t == 0 and skip_special_tokens):
                out.append("</s>" if t == 0 else chr(t))
        return "".join(out) + ("\ufffd" if pending else "")


def stream_of(text_tokens, stop=()):
    stream = TextStream(Letters(), stop)
    pieces = [stream.push(t) for t in text_tokens]
    return pieces, stream


def test_a_stop_string_ends_the_text_before_it_and_its_prefix_is_held_back():
    pieces, stream = stream_of([ord(c) for c in "abc END xyz"], stop=("END",))
    assert stream.stopped and stream.text == "abc " and "".join(pieces) == "abc "
    assert pieces[4:7] == ["", "", ""]  # " E", "EN": a stop string may be starting: nothing sent
    pieces, stream = stream_of([ord(c) for c in "abc ENd"], stop=("END",))
    assert not stream.stopped and pieces[-1] == "ENd"  # sent once it can no longer become the stop string
    pieces, stream = stream_of([ord(c) for c in "abc EN"], stop=("END",))
    assert "".join(pieces) == "abc "
    assert stream.finish() == "EN" and stream.text == "abc EN"  # the held-back prefix never completed


def test_an_unfinished_character_waits_and_the_end_of_sequence_is_not_text():
    pieces, stream = stream_of([ord("a"), 1, 2, 0])
    assert pieces == ["a", "", "é", ""]
    assert stream.finish() == "" and stream.text == "aé"
