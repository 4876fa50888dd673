"""The tool-use toy task: verifier (including what a tool rollout's text looks like), spec parsing, sampling, and
the toy's multi-turn warm-start transcripts."""

import random

import numpy as np
import pytest

from stare_jax.tasks import get_task, tool_mul as tm
from stare_jax.tools.calls import RETOOL, parse_call
from stare_jax.toy import assets as toy


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("195434", "37:4:258", 1.0),  # 37 * 5282
        (" 195434\n", "37:4:258", 1.0),
        ("195435", "37:4:258", 0.0),  # not a multiple of 37
        (str(37 * 5283), "37:4:258", 0.0),  # 3 is not in the set
        (str(37 * 528), "37:4:258", 0.0),  # 3 digits, not 4
        (str(37 * 52822), "37:4:258", 0.0),
        ("", "37:4:258", 0.0),
        ("abc", "37:4:258", 0.0),
        ("19 5434", "37:4:258", 0.0),
        ("-195434", "37:4:258", 0.0),
        # what a tool rollout's whole text looks like: only the text after the last closing tag is read
        ("<code>print(37*5282)</code>\n<interpreter>\n195434\n</interpreter>\n195434", "37:4:258", 1.0),
        ("<code>print(37*5282)</code>\n<interpreter>\n195434\n</interpreter>\n", "37:4:258", 0.0),
        ("<code>print(37*5282)</code>195434", "37:4:258", 1.0),  # tool disabled: a guess after the call
        ("<code>print(37*5282)</code>", "37:4:258", 0.0),
    ],
)
def test_score(response, answer, expected):
    assert tm.score(response, answer) == expected


def test_bad_spec():
    for bad in [
        "37:4",
        "x:4:258",
        "37:y:258",
        "37:4:",
        "37:4:2a8",
        "37:4:228",
        "37:0:258",
        "40:4:258",
        "1:4:258",
        "37:4:058",
    ]:
        with pytest.raises(ValueError, match="spec"):
            tm.parse_spec(bad)


def test_spec_round_trip_and_prompt():
    assert tm.parse_spec(tm.spec(37, 4, "258")) == (37, 4, "258")
    assert tm.prompt_text(37, 4, "258") == "mul 37 by 4 from 2 5 8 ="
    assert get_task("tool_mul") is tm


def test_sampled_answers_valid_and_varied():
    rng = random.Random(0)
    answers = {tm.sample_answer(37, 3, "258", rng) for _ in range(2000)}
    assert len(answers) == 27 and all(tm.score(a, "37:3:258") == 1.0 for a in answers)


def test_call_text_parses_as_a_retool_call():
    call = parse_call(tm.call_text(37, "5282"), "retool", calls_so_far=0, max_turns=2)
    assert call is not None and call.code == "print(37*5282)"


def test_all_specs_leave_out_multiples_of_ten():
    specs = tm.all_specs((11, 21), (3, 3), 3)
    assert {m for m, _, _ in specs} == set(range(11, 22)) - {20}
    assert len(specs) == 10 * 84


def test_toy_transcripts_and_splits():
    cfg = toy.ToyAssetConfig(
        task="tool_mul", k_min=3, k_max=4, num_train=50, num_eval=10, sft_noise=0.0, sft_direct_frac=0.0
    )
    train, held = toy.make_splits(cfg)
    assert {r["answer"] for r in train}.isdisjoint({r["answer"] for r in held})
    rng = random.Random(0)
    for r in train[:20]:
        sp = tm.parse_spec(r["answer"])
        call, obs, answer = toy.tool_transcript(cfg, sp, rng)
        assert call[1] == 1 and obs[1] == 0 and answer[1] == 1
        assert obs[0] == RETOOL.wrap(answer[0]) and tm.score(answer[0], r["answer"]) == 1.0
    direct = toy.tool_transcript(toy.ToyAssetConfig(task="tool_mul", sft_direct_frac=1.0), (37, 4, "258"), rng)
    assert len(direct) == 1 and direct[0][0].isdigit()


def test_encode_transcript_masks_the_observation():
    class Tok:  # one id per character, BOS 1, EOS 2
        eos_id = 2

        def encode(self, text, add_bos=False):
            return ([1] if add_bos else []) + [10 + ord(c) % 50 for c in text]

    segments = [("<code>x</code>", 1), ("\n<i>\n7\n</i>\n", 0), ("7", 1)]
    ids, mask = toy.encode_transcript(Tok(), "p =", segments)
    assert len(ids) == len(mask) == 1 + 3 + 14 + 12 + 1 + 1
    np.testing.assert_array_equal(mask, [0] * 4 + [1] * 14 + [0] * 12 + [1, 1])
    assert ids[-1] == 2


def test_toy_tokenizer_keeps_the_call_format_short(tmp_path):
    """The tool_mul tokenizer: `<code>print(` and each tag are one piece, no dummy-prefix piece, so a call is
    k + 6 tokens and the closing tag is one stop token."""
    from stare_jax.data.tokenizer import load_tokenizer

    cfg = toy.ToyAssetConfig(task="tool_mul", k_min=4, k_max=6, set_size=4, vocab_size=44)
    tok = load_tokenizer(toy.train_tokenizer(cfg, tmp_path / "tok"))
    pieces = [tok.id_to_token(i) for i in tok.encode(tm.call_text(37, "54282"), add_bos=False)]
    assert pieces == ["<code>print(", "3", "7", "*", "5", "4", "2", "8", "2", ")", "</code>"]
    assert [tok.id_to_token(i) for i in tok.encode("<code>", add_bos=False)] == ["<code>"]
    assert len(tok.encode("2008434", add_bos=False)) == 7  # digits split, no leading "▁" piece
    assert tok.decode(tok.encode(tm.call_text(37, "54282"), add_bos=False), skip_special_tokens=False) == tm.call_text(
        37, "54282"
    )
