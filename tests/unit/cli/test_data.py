"""`stare-jax data list` / `stare-jax data prepare ... --from-local` run in this process: what they print, the files
they write, one-line errors with exit status 2; and the default data folder `stare-jax eval` reads, whose missing
files name the command that writes them. No network."""

import json

import pytest

from stare_jax import cli
from stare_jax.data.prepare import DATASETS


def _main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(result, *needles):
    code, _, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_list_names_every_dataset(capsys):
    code, out, _ = _main(capsys, "data", "list")
    assert code == 0
    for d in DATASETS.values():
        line = next(ln for ln in out.splitlines() if ln.startswith(d.name + " "))
        assert d.repo in line and d.out_file in line and d.split in line


def test_prepare_from_a_local_copy(capsys, tmp_path):
    hub = tmp_path / "test.jsonl"  # math-ai/aime25's file
    hub.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"problem": "p1", "answer": "70", "id": "0"}, {"problem": "p2", "answer": None, "id": "1"}]
        )
    )
    out = tmp_path / "data" / "math"
    code, stdout, err = _main(capsys, "data", "prepare", "aime25", "--out", out, "--from-local", hub)
    assert code == 0, err
    assert stdout.strip() == (
        f"aime25: wrote 1 rows to {out / 'aime25.jsonl'}; skipped 1 rows that could not be converted (1 no 'answer')"
    )
    assert [json.loads(x) for x in (out / "aime25.jsonl").read_text().splitlines()] == [
        {"id": "aime25-0", "problem": "p1", "answer": "70", "source": "AIME 2025"}
    ]


def test_prepare_wrong_inputs(capsys, tmp_path):
    _one_line_error(
        _main(capsys, "data", "prepare", "math501", "--from-local", tmp_path), "unknown dataset 'math501'", "math500"
    )
    _one_line_error(
        _main(capsys, "data", "prepare", "aime24", "aime25", "--from-local", tmp_path), "--from-local", "one dataset"
    )
    _one_line_error(_main(capsys, "data", "prepare", "all", "--from-local", tmp_path), "one dataset")
    _one_line_error(
        _main(capsys, "data", "prepare", "aime24", "--from-local", tmp_path / "nope"), "no such file or folder"
    )
    with pytest.raises(SystemExit) as e:  # argparse: no subcommand
        cli.main(["data"])
    assert e.value.code == 2


def test_eval_reads_data_math_and_names_the_prepare_command(capsys, tmp_path, monkeypatch):
    """`stare-jax eval`'s --data-dir defaults to data/math (in the checkout, where `data prepare` writes); a missing
    benchmark file is one line naming the command that downloads it."""
    args = cli.build_parser(["eval"]).parse_args(["eval", "--checkpoint", "x"])
    assert args.data_dir == "data/math"
    monkeypatch.chdir(tmp_path)
    _one_line_error(
        _main(capsys, "eval", "--checkpoint", tmp_path, "--benchmarks", "math500"),
        "no math500.jsonl in --data-dir data/math",
        "`stare-jax data prepare math500 --out data/math`",
    )
    _one_line_error(
        _main(capsys, "eval", "--checkpoint", tmp_path, "--benchmarks", "aime24,gsm8k", "--data-dir", "d"),
        "no aime24.jsonl, gsm8k_test.jsonl in --data-dir d",
        "`stare-jax data prepare aime24 gsm8k --out d`",
    )
