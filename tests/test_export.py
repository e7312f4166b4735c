"""``bubblefree export --format hf``: the folder loads offline in transformers, its logits are ours, its
tokenizer is ours. The reference is the installed transformers library (the ``hf`` extra, also in ``test``)."""

from __future__ import annotations

import pytest
import torch

from bubblefree.cli import main
from bubblefree.data.tokenizer import ByteTokenizer
from bubblefree.export import load_run_model

transformers = pytest.importorskip("transformers")

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune,\n" \
       "must be in want of a wife. Ünïcödé — ‘quotes’ 😀\ttabs  and   spaces\n"


@pytest.fixture(autouse=True)
def _session_cache(data_cache):
    """The session's data cache (conftest.py): the BPE is trained once per session."""


def _train(out, *extra: str) -> None:
    assert main(["train", "--preset", "smoke", "--set", "train.steps=6", "--set", "train.seq_len=32",
                 "--set", "train.batch_size=4", "--set", "train.eval_batches=2", "--set", "log.progress=false",
                 *extra, "--out", str(out)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_export_loads_offline_with_our_logits_and_tokens(tmp_path, monkeypatch, tokenizer):
    run, out = tmp_path / "run", tmp_path / "hf"
    _train(run, "--set", f"data.tokenizer={tokenizer}", "--set", "data.vocab_size=512")
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(hf).__name__ == "LlamaForCausalLM" and tok.is_fast

    model, ours_tok, _ = load_run_model(run)
    assert isinstance(ours_tok, ByteTokenizer) == (tokenizer == "byte")
    ids = ours_tok.encode(TEXT)
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ids  # the same tokens
    assert tok.decode(ids) == TEXT  # and back to the same text
    x = torch.tensor([ids[:64], ids[1:65]])
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert ours.abs().max() > 0.5  # trained logits, not near-zero ones
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * float(ours.abs().max()))  # float32


@pytest.mark.slow
def test_moe_and_bad_sources_are_one_line_errors(tmp_path, capsys):
    run = tmp_path / "moe"
    _train(run, "--set", "model.preset=moe-20m", "--set", "train.steps=1", "--set", "train.eval_batches=1")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixture of experts" in err and not (tmp_path / "hf").exists()
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf")]) == 2
    assert "neither a run folder nor a checkpoint file" in capsys.readouterr().err
