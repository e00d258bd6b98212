"""Loading and saving checkpoints: round trips, interoperability with transformers, and every error path."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from probe import HookedDecoder
from probe.loading import CheckpointError


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_save_load_round_trip_is_bit_exact(tiny_model, tmp_path, tokens):
    out = tiny_model.save_pretrained(tmp_path / "saved")
    again = HookedDecoder.from_pretrained(out).eval()
    for (name, a), (_, b) in zip(tiny_model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert again.cfg == tiny_model.cfg
    with torch.no_grad():
        assert torch.equal(again(tokens), tiny_model(tokens))
    assert again.to_tokens("To be").tolist() == tiny_model.to_tokens("To be").tolist()


def test_transformers_loads_what_we_save(tiny_model, tmp_path, tokens):
    from transformers import GPT2LMHeadModel

    out = tiny_model.save_pretrained(tmp_path / "saved")
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, tiny_model(tokens), atol=1e-4, rtol=0)


def test_save_refuses_to_overwrite(tiny_model, tmp_path):
    target = tmp_path / "results"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        tiny_model.save_pretrained(target)
    assert (target / "mine.txt").read_text() == "keep me"
    tiny_model.save_pretrained(target, overwrite=True)
    assert not (target / "mine.txt").exists() and (target / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # no temporary or set-aside siblings left


def test_failed_save_leaves_nothing_under_the_final_name(tiny_model, tmp_path, monkeypatch):
    import probe.loading

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(probe.loading, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        tiny_model.save_pretrained(tmp_path / "saved")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_created_during_the_save_is_never_replaced(tiny_model, tmp_path, monkeypatch):
    import probe.loading

    target, real_save_file = tmp_path / "results", probe.loading.save_file

    def another_run_finishes_first(*args, **kwargs):
        target.mkdir()
        (target / "theirs.txt").write_text("keep me")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(probe.loading, "save_file", another_run_finishes_first)
    with pytest.raises(FileExistsError, match="created by something else"):
        tiny_model.save_pretrained(target)
    assert [p.name for p in tmp_path.iterdir()] == ["results"] and (target / "theirs.txt").read_text() == "keep me"


def test_weights_only_bin_checkpoint_loads(tiny_dir, tmp_path, tokens):
    directory = copy_checkpoint(tiny_dir, tmp_path / "bin")
    state = load_file(str(directory / "model.safetensors"))
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    reference = HookedDecoder.from_pretrained(tiny_dir)
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained(directory)(tokens), reference(tokens))


class _RunsCode:
    """Unpickling this calls os.system: the classic malicious checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code_is_refused(tiny_dir, tmp_path):
    directory = copy_checkpoint(tiny_dir, tmp_path / "evil")
    (directory / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    with open(directory / "pytorch_model.bin", "wb") as f:
        pickle.dump({"wte.weight": _RunsCode(marker)}, f)
    with pytest.raises(CheckpointError, match="refused"):
        HookedDecoder.from_pretrained(directory)
    assert not marker.exists()


def test_sharded_safetensors(tiny_dir, tmp_path, tokens):
    directory = copy_checkpoint(tiny_dir, tmp_path / "sharded")
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-1.safetensors": names[: len(names) // 2], "model-2.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, str(directory / shard))
        weight_map.update({k: shard for k in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained(directory)(tokens), HookedDecoder.from_pretrained(tiny_dir)(tokens))


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def edit_weights(directory: Path, edit) -> None:
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(directory / "model.safetensors")).items()}
    edit(state)
    save_file(state, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "breakage,match",
    [
        (lambda d: (d / "config.json").unlink(), "config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights"),
        (lambda d: edit_config(d, model_type="bert"), "model_type 'bert' is not supported; supported: gpt2"),
        (lambda d: edit_config(d, n_head=5), "n_heads=5"),
        (lambda d: edit_config(d, n_embd=32, n_head=4), "'wte.weight'.*shape"),
        (lambda d: edit_weights(d, lambda s: s.pop("h.1.mlp.c_fc.bias")), "missing the tensor 'h.1.mlp.c_fc.bias'"),
        (lambda d: edit_weights(d, lambda s: s.update({"h.0.attn.c_attn.weight": torch.zeros(64, 100)})),
         r"'h.0.attn.c_attn.weight'.*\(64, 100\).*\(64, 192\)"),
        (lambda d: edit_weights(d, lambda s: s.update({"h.7.extra.weight": torch.zeros(2)})), "h.7.extra.weight"),
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]), "safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "safetensors"),
        (lambda d: edit_weights(d, lambda s: s["h.1.ln_2.weight"].__setitem__(3, float("nan"))), "'h.1.ln_2.weight'.*NaN"),
    ],
    ids=["no-config", "bad-json", "no-weights", "model-type", "inconsistent-config", "config-vs-weights",
         "missing-tensor", "wrong-shape", "unexpected-tensor", "truncated", "garbage", "nan-weights"],
)
def test_broken_checkpoints_get_clear_errors(tiny_dir, tmp_path, breakage, match):
    directory = copy_checkpoint(tiny_dir, tmp_path / "broken")
    breakage(directory)
    with pytest.raises(CheckpointError, match=match):
        HookedDecoder.from_pretrained(directory)


def test_missing_directory_and_unknown_name():
    with pytest.raises(CheckpointError, match="does not exist"):
        HookedDecoder.from_pretrained("./no/such/checkpoint")
    with pytest.raises(CheckpointError, match="supported names: gpt2, gpt2-medium"):
        HookedDecoder.from_pretrained("gpt3")


def test_hub_name_offline_with_empty_cache_says_what_to_do(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="local directory"):
        HookedDecoder.from_pretrained("gpt2")


def test_hub_name_found_in_local_cache_offline(tiny_dir, tmp_path, monkeypatch, tokens):
    """An offline machine with the model in its Hugging Face cache loads it without any request."""
    import huggingface_hub.constants as hub

    repo = tmp_path / "models--openai-community--gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(tiny_dir, repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained("gpt2")(tokens), HookedDecoder.from_pretrained(tiny_dir)(tokens))


def test_pythia_training_checkpoints_by_revision_from_the_local_cache(tmp_path, monkeypatch):
    """`from_pretrained("pythia-70m", revision="step1000")` reads that branch of EleutherAI/pythia-70m; offline,
    from the cache. Two revisions with different weights give different models, each equal to its files."""
    import huggingface_hub.constants as hub

    from test_variants import build

    repo = tmp_path / "models--EleutherAI--pythia-70m"
    (repo / "refs").mkdir(parents=True)
    models = {}
    for seed, revision in enumerate(("main", "step1000")):
        commit = str(seed + 1) * 40
        (repo / "refs" / revision).write_text(commit)
        torch.manual_seed(seed)
        models[revision] = build("neox", repo / "snapshots" / commit, layer_norm_eps=1e-5 * (seed + 1))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    tokens = torch.randint(0, 103, (1, 9), generator=torch.Generator().manual_seed(0))
    for revision, hf in models.items():
        ours = HookedDecoder.from_pretrained("pythia-70m", revision=None if revision == "main" else revision)
        assert ours.cfg.eps == hf.config.layer_norm_eps
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(CheckpointError, match="at revision 'step9'.*hf download EleutherAI/pythia-70m --revision step9"):
        HookedDecoder.from_pretrained("pythia-70m", revision="step9")
    with pytest.raises(CheckpointError, match="local directory, which has only the version it holds"):
        HookedDecoder.from_pretrained(repo / "snapshots" / ("1" * 40), revision="step1000")


def test_weights_only_directory_loads_without_tokenizer(tiny_dir, tmp_path, tokens):
    directory = copy_checkpoint(tiny_dir, tmp_path / "no-tok")
    (directory / "tokenizer.json").unlink()
    model = HookedDecoder.from_pretrained(directory)
    assert model.tokenizer is None
    model(tokens)
    with pytest.raises(ValueError, match="no tokenizer"):
        model.to_tokens("hello")


def test_vocab_and_merges_tokenizer_files(tiny_dir, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    directory = copy_checkpoint(tiny_dir, tmp_path / "old-style")
    backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    backend.model.save(str(directory))  # writes vocab.json and merges.txt
    (directory / "tokenizer.json").unlink()
    old_style = HookedDecoder.from_pretrained(directory)
    text = "The quick brown fox jumps over the lazy dog"
    assert old_style.to_tokens(text).tolist() == HookedDecoder.from_pretrained(tiny_dir).to_tokens(text).tolist()


def test_saved_files_get_umask_permissions_not_private_ones(tiny_model, tmp_path):
    import stat

    umask = os.umask(0o022)
    try:
        out = tiny_model.save_pretrained(tmp_path / "shared")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644


def test_any_hub_repository_id_is_looked_up_in_the_cache_first(tmp_path, monkeypatch):
    """Llama-family checkpoints are named owner/name on the hub; offline, the local cache serves them."""
    import huggingface_hub.constants as hub

    from test_variants import build

    source = tmp_path / "src"
    build("llama", source)
    (source / "generation_config.json").unlink(missing_ok=True)
    repo = tmp_path / "cache" / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("1" * 40)
    shutil.copytree(source, repo / "snapshots" / ("1" * 40))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    tokens = torch.randint(0, 101, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained("someone/tiny-llama")(tokens), HookedDecoder.from_pretrained(source)(tokens))
    with pytest.raises(CheckpointError, match="no local directory someone/missing.*local directory"):
        HookedDecoder.from_pretrained("someone/missing")


def test_gpt1_checkpoint_with_its_bos_free_tokenizer_loads_and_runs_text(tmp_path):
    """openai-gpt's tokenizer (word-level BPE with `</w>` suffixes) has no `<|endoftext|>` and no BOS."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from conftest import TOKENIZER_TEXT
    from test_variants import build

    hf = build("gpt1", tmp_path)
    tok = HFTokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.BPEDecoder(suffix="</w>")
    tok.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(vocab_size=hf.config.vocab_size, special_tokens=["<unk>"],
                                                                end_of_word_suffix="</w>", show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    model = HookedDecoder.from_pretrained(tmp_path).eval()
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text).ids  # nothing prepended: GPT-1 was trained without a BOS
    assert model.to_tokens(text).tolist() == [ids]
    with torch.no_grad():
        torch.testing.assert_close(model(text), hf(torch.tensor([ids])).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="no BOS token.*prepend_bos=False"):
        model.to_tokens(text, prepend_bos=True)
    out = model.generate(text, max_new_tokens=3)
    assert out == tok.decode(model.generate(torch.tensor([ids]), max_new_tokens=3)[0].tolist())
