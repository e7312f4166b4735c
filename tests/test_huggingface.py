"""Hugging Face folders in (``model.init_from``) and out (``bubblefree export``): a folder that transformers wrote
from a random ``LlamaForCausalLM`` gives its logits in our model, export -> import -> export is bit-exact, a
continued-pretraining run trains, resumes and exports, and whatever our model does not compute is refused in
one line. The reference is the installed transformers library (the ``hf`` extra, also in ``test``)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import processors

from bubblefree.config import ModelConfig, read_toml
from bubblefree.data import load_tokens
from bubblefree.data.tokenizer import BPETokenizer, ByteTokenizer
from bubblefree.errors import UserError
from bubblefree.export import byte_tokenizer, load_run_model, write_hf
from bubblefree.models import ModelArgs, Transformer, token_loss
from bubblefree.models.hf import (
    fingerprint,
    hf_name,
    load_hf_model,
    model_args_from_hf,
    our_name,
    read_hf_folder,
)
from bubblefree.models.presets import model_args
from bubblefree.train.build import train_microbatch
from bubblefree.train.presets import load_config
from helpers import folder_digest, run_cli

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
"""The embedding's rows: more than the tokenizer's 257 tokens, as in released models padded to a round size."""

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune,\n" \
       "must be in want of a wife. Ünïcödé — ‘quotes’ 😀\ttabs  and   spaces\n"


def tokenizer_json():
    """Bytes as tokens 0-255 plus ``<s>`` (256), which the post-processor puts before every text, as LLaMA
    tokenizers do: the runs must not get it."""
    tok = byte_tokenizer()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return tok


def write_llama(folder: Path, *, tie: bool = False, shard: bool = False, seed: int = 0):
    """A random 2-layer ``LlamaForCausalLM`` (dim 32, 4 query / 2 key-value heads) with every weight moved far from
    its init (norm gains too), saved by transformers with its tokenizer; returns the model."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=5e4, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder, max_shard_size="30KB" if shard else "1GB")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer_json()).save_pretrained(folder)
    return hf


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------- in: the mapping


def test_names_map_both_ways():
    model = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=64),
                        device="meta")
    for name in model.state_dict():
        assert our_name(hf_name(name)) == name
    assert our_name("model.layers.0.self_attn.q_proj.bias") is None  # a bias has no place in our model


@pytest.mark.parametrize("tie, shard", [(False, False), (True, False), (False, True)],
                         ids=["untied", "tied", "sharded"])
def test_transformers_folder_gives_our_logits(tmp_path, tie, shard):
    hf = write_llama(tmp_path, tie=tie, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    folder = read_hf_folder(tmp_path)
    ours = load_hf_model(folder)
    assert folder.args == ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64,
                                    rope_theta=5e4, norm_eps=1e-5, tie_embeddings=tie, max_seq_len=128)
    assert (ours.lm_head.weight is ours.embed.weight) == tie
    assert model_args(ModelConfig(init_from=str(tmp_path))) == folder.args  # what plan and the length checks read
    x = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(x).logits, ours(x)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    # float32 through 2 layers: within 1e-5 relative to the logit scale (the two agree bit for bit here).
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


@pytest.mark.parametrize("tie", [False, True])
def test_export_import_export_is_bit_exact(tmp_path, tie):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64,
                                  rope_theta=1e5, tie_embeddings=tie))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    first = write_hf(model, ByteTokenizer(), tmp_path / "first")
    folder = read_hf_folder(first)
    again = write_hf(load_hf_model(folder), BPETokenizer(folder.tokenizer), tmp_path / "again")
    a, b = tensors(first), tensors(again)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert fingerprint(read_hf_folder(again)) == fingerprint(folder)


def test_the_folder_tokenizer_encodes_without_special_tokens(tmp_path, data_cache):
    write_llama(tmp_path / "hf")
    (tmp_path / "text.txt").write_text(TEXT * 40)
    folder = read_hf_folder(tmp_path / "hf")
    assert folder.tokenizer.encode("ab").ids == [256, 97, 98]  # the folder's own post-processor adds <s> ...
    data = load_tokens(load_config("smoke", None, [f"data.source={tmp_path / 'text.txt'}"]).data,
                       tokenizer=folder.tokenizer)
    assert data.tokenizer.encode(TEXT) == list(TEXT.encode("utf-8"))  # ... a run's tokens do not have it
    assert data.vocab_size == 257 and 256 not in set(data.train.tolist()) | set(data.val.tolist())


# ----------------------------------------------------------------------------------------- in: refusals

REFUSED = [
    ({"model_type": "mistral"}, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"head_dim": 16}, "head_dim"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 200}, "tokenizer.json has 257 tokens"),
]


@pytest.mark.parametrize("changes, named", REFUSED, ids=[n for _, n in REFUSED])
def test_what_our_model_does_not_compute_is_refused(tmp_path, changes, named):
    write_llama(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(UserError, match="Invalid model.init_from") as err:
        read_hf_folder(tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_transformers_4_config_is_read():
    """transformers 4.x writes ``rope_theta`` at the top and ``rope_scaling: null``; 5.x ``rope_parameters``."""
    old = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rope_theta": 5e5, "rope_scaling": None, "pretraining_tp": 1, "tie_word_embeddings": True}
    args = model_args_from_hf(old, where="config.json")
    assert (args.rope_theta, args.norm_eps, args.tie_embeddings, args.max_seq_len) == (5e5, 1e-6, True, 2048)


@pytest.mark.parametrize("case", ["bias", "missing", "shape"])
def test_weights_that_do_not_fit_are_refused(tmp_path, case):
    write_llama(tmp_path)
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    if case == "bias":
        weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    elif case == "missing":
        del weights["model.layers.1.mlp.up_proj.weight"]
    else:
        weights["model.norm.weight"] = torch.ones(31)
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = {"bias": "holds model.layers.0.self_attn.q_proj.bias, which bubblefree's LLaMA has no place for",
                "missing": "has no model.layers.1.mlp.up_proj.weight",
                "shape": "model.norm.weight of shape [31], config.json makes it [32]"}[case]
    with pytest.raises(UserError, match="Invalid model.init_from") as err:
        load_hf_model(read_hf_folder(tmp_path))
    assert expected in str(err.value)


def test_an_unsupported_folder_is_one_line_exit_2_and_writes_nothing(tmp_path):
    write_llama(tmp_path / "hf")
    edit_config(tmp_path / "hf", attention_bias=True)
    before = folder_digest(tmp_path)
    code, err = run_cli(["train", "--preset", "smoke", "--set", f"model.init_from={tmp_path / 'hf'}",
                         "--out", str(tmp_path / "run")])
    assert code == 2 and err.count("\n") == 1 and "attention_bias = true" in err, err
    assert not (tmp_path / "run").exists() and folder_digest(tmp_path) == before



def test_a_hub_id_as_the_model_folder_says_how_to_get_the_folder(tmp_path):
    """data.source takes ``hf:NAME`` from the hub; model.init_from reads a folder only, and says so."""
    code, err = run_cli(["train", "--preset", "smoke", "--set", "model.init_from=hf:HuggingFaceTB/SmolLM2-135M",
                         "--out", str(tmp_path / "run")])
    assert code == 2 and err.count("\n") == 1 and "never fetched from the hub" in err, err
    assert "--local-dir DIR" in err and not (tmp_path / "run").exists()

# ------------------------------------------------------------------------------ a continued-pretraining run


@pytest.mark.slow
def test_continued_pretraining_trains_resumes_and_exports(tmp_path, data_cache):
    hf = write_llama(tmp_path / "hf", shard=True)
    (tmp_path / "text.txt").write_text(TEXT * 60)
    run = tmp_path / "run"
    options = ["--set", f"model.init_from={tmp_path / 'hf'}", "--set", f"data.source={tmp_path / 'text.txt'}",
               "--set", "train.steps=6", "--set", "train.seq_len=32", "--set", "train.batch_size=4",
               "--set", "train.eval_batches=2", "--set", "train.ckpt_every=3", "--set", "train.log_every=1",
               "--set", "log.progress=false"]
    code, err = run_cli(["train", "--preset", "smoke", *options, "--out", str(run)])
    assert code == 0, err

    model = read_toml(run / "config.toml")["model"]
    folder = read_hf_folder(tmp_path / "hf")
    assert model["init_from"] == str(folder.path) and model["init_sha256"] == fingerprint(folder)
    assert model["vocab_size"] == VOCAB
    # Step 1's loss is the folder's model on the first batch (our tokens, transformers' logits): it started there.
    config = load_config("smoke", None, [o for o in options if o != "--set"])
    data = load_tokens(config.data, tokenizer=folder.tokenizer)
    micro = config.pipeline.microbatches
    with torch.no_grad():
        losses = [token_loss(hf(x).logits, y) for x, y in
                  (train_microbatch(config.train, micro, data.train, 0, i, "cpu") for i in range(micro))]
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and math.isclose(first["loss"], float(sum(losses)) / micro, rel_tol=1e-5)

    # Resume from step 3 (--branch keeps the first ending aside): the same weights at step 6, bit for bit.
    assert run_cli(["export", str(run), "--out", str(tmp_path / "straight")])[0] == 0
    code, err = run_cli(["train", "--resume", str(run / "checkpoints" / "step_00000003.pt"), "--branch"])
    assert code == 0, err
    assert run_cli(["export", str(run), "--out", str(tmp_path / "resumed")])[0] == 0
    straight, resumed = tensors(tmp_path / "straight"), tensors(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert not torch.equal(straight["model.norm.weight"], hf.model.norm.weight)  # and it trained
    ours, tokenizer, _ = load_run_model(run)
    assert tokenizer.encode(TEXT) == list(TEXT.encode("utf-8"))  # the folder's tokenizer, without <s>

    # Export -> import -> export: the same tensors again.
    imported = read_hf_folder(tmp_path / "resumed")
    write_hf(load_hf_model(imported), BPETokenizer(imported.tokenizer), tmp_path / "again")
    again = tensors(tmp_path / "again")
    assert again.keys() == resumed.keys() and all(torch.equal(again[k], resumed[k]) for k in again)

    # Another folder under the same name: the resume is refused in one line and touches nothing.
    shutil.rmtree(tmp_path / "hf")
    write_llama(tmp_path / "hf", shard=True, seed=1)
    before = folder_digest(run)
    code, err = run_cli(["train", "--resume", str(run), "--set", "train.steps=8"])
    assert code == 2 and err.count("\n") == 1 and "is not the model the run started from" in err, err
    assert folder_digest(run) == before
