"""Loading and saving checkpoints: round trips, interoperability with transformers, and every error path."""
from __future__ import annotations

import fnmatch
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


def test_sharded_weights_only_bin_checkpoint_loads(tiny_dir, tmp_path, tokens):
    """transformers' older sharded layout: pytorch_model.bin.index.json naming pytorch_model-0000N-of-0000M.bin."""
    directory = copy_checkpoint(tiny_dir, tmp_path / "bin-sharded")
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in halves.items():
        torch.save({k: state[k] for k in keys}, directory / shard)
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reference = HookedDecoder.from_pretrained(tiny_dir)
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained(directory)(tokens), reference(tokens))
    (directory / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match=r"pytorch_model-00002-of-00002.bin is missing \(the shard index names it\)"):
        HookedDecoder.from_pretrained(directory)


def test_a_hub_repository_with_only_pickled_weights_is_asked_for_them_once_safetensors_are_absent(
        tiny_dir, tmp_path, tokens, monkeypatch):
    """OPT's, the TinyStories models' and many training checkpoints' repositories hold pytorch_model.bin only: the
    pickles are asked for (local cache first) when the first snapshot has no weights, and never otherwise."""
    import huggingface_hub

    pickled = copy_checkpoint(tiny_dir, tmp_path / "hub-bin")
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False, **_):
        asked.append((tuple(allow_patterns), local_files_only))
        target = tmp_path / "snapshots" / repo_id  # one folder per repository, filled by each call, as the cache is
        target.mkdir(parents=True, exist_ok=True)
        for source in (pickled, tiny_dir)[repo_id == "owner/safe"].iterdir():
            if any(fnmatch.fnmatch(source.name, pattern) for pattern in allow_patterns):
                shutil.copy(source, target / source.name)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    reference = HookedDecoder.from_pretrained(tiny_dir)
    with torch.no_grad():
        assert torch.equal(HookedDecoder.from_pretrained("owner/pickled")(tokens), reference(tokens))
    assert [(("pytorch_model.bin" in patterns), local) for patterns, local in asked] == [(False, True), (True, True)]
    asked.clear()
    HookedDecoder.from_pretrained("owner/safe")
    assert len(asked) == 1 and not any("pytorch_model" in pattern for pattern in asked[0][0])


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


# ---- hostile and careless files (issue 24, classes 5-7): one line naming the file and the field ----------------
def shard(directory: Path, split=lambda names: (names[: len(names) // 2], names[len(names) // 2:]), index=None) -> None:
    """Split model.safetensors into two shards and an index (or write `index` as the index's text)."""
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    weight_map = {}
    for i, keys in enumerate(split(sorted(state)), start=1):
        save_file({k: state[k].contiguous() for k in keys}, str(directory / f"model-{i}.safetensors"))
        weight_map.update({k: f"model-{i}.safetensors" for k in keys})
    (directory / "model.safetensors.index.json").write_text(index if index is not None else json.dumps({"weight_map": weight_map}))


def rewrite_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    "breakage,match",
    [
        (lambda d: (d / "config.json").write_text("[1, 2]"), r"config.json holds a JSON array, not an object"),
        (lambda d: (d / "config.json").write_text('"gpt2"'), r"config.json holds a JSON string"),
        (lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000), r"config.json is nested too deeply"),
        (lambda d: (d / "config.json").write_bytes(b'{"model_type": "gpt2\xff"}'), r"config.json is not UTF-8"),
        (lambda d: edit_config(d, model_type=["gpt2"]), r"model_type \['gpt2'\] is not supported"),
        (lambda d: edit_config(d, n_layer="2"), r"config.json: n_layer must be a positive integer, got the string '2'"),
        (lambda d: edit_config(d, n_layer=2.5), r"config.json: n_layer must be a positive integer, got 2.5"),
        (lambda d: edit_config(d, n_embd=True), r"config.json: n_embd must be a positive integer, got true"),
        (lambda d: edit_config(d, n_head=None), r"config.json: n_head must be a positive integer, got null"),
        (lambda d: edit_config(d, layer_norm_epsilon="1e-5"), r"layer_norm_epsilon must be a finite number"),
        (lambda d: edit_config(d, scale_attn_weights="false"), r"scale_attn_weights must be true or false"),
        (lambda d: edit_config(d, activation_function=["gelu"]), r"activation_function must be a string"),
        (lambda d: edit_config(d, heads_per_layer={"0": 4}), r"heads_per_layer must be a list"),
        (lambda d: edit_config(d, n_layer=10**7), r"n_layer=10000000, but the weights hold 2 layers"),
        (lambda d: edit_config(d, n_layer=10**400), r"n_layer=1000.*but the weights hold 2 layers"),
        (lambda d: shard(d, index="[]"), r"index.json holds a JSON array"),
        (lambda d: shard(d, index='{"weight_map": ["model-1.safetensors"]}'), r"index.json: weight_map must be a non-empty object"),
        (lambda d: shard(d, index='{"metadata": {}}'), r"index.json: weight_map must be a non-empty object"),
        (lambda d: shard(d, index='{"weight_map": {"wte.weight": 3}}'), r"index.json: weight_map\['wte.weight'\] must be a shard"),
        (lambda d: shard(d, index='{"weight_map": {"wte.weight": "../outside.safetensors"}}'), r"outside the checkpoint"),
        (lambda d: shard(d, index='{"weight_map": {"wte.weight": "/etc/passwd"}}'), r"outside the checkpoint"),
        (lambda d: shard(d, index='{"weight_map": {"wte.weight": "model-9.safetensors"}}'), r"model-9.safetensors is missing"),
        (lambda d: shard(d, lambda names: (names, names[:3])), r"is in two shards of .*model-2.safetensors"),
        (lambda d: edit_weights(d, lambda s: s.update({"h.0.ln_1.weight": torch.ones(64, dtype=torch.int32)})),
         r"'h.0.ln_1.weight' .* is stored as int32; weights must be float16"),
        (lambda d: edit_weights(d, lambda s: s.update({"h.0.ln_1.bias": torch.zeros(64, dtype=torch.bool)})),
         r"'h.0.ln_1.bias' .* is stored as bool"),
        (lambda d: edit_weights(d, lambda s: s.update({"h.1.mlp.c_fc.weight": s["h.1.mlp.c_fc.weight"].to(torch.float8_e4m3fn)})),
         r"'h.1.mlp.c_fc.weight' .* is stored as float8_e4m3fn"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), r"tokenizer.json: not a tokenizer the tokenizers library can read"),
        (lambda d: (d / "tokenizer.json").write_text('{"model": [1, 2]}'), r"tokenizer.json: not a tokenizer"),
        (lambda d: (d / "tokenizer.json").write_text("[]"), r"tokenizer.json: not a tokenizer"),
        (lambda d: (d / "tokenizer_config.json").write_text("{oops"), r"tokenizer_config.json is not valid JSON"),
        (lambda d: (d / "tokenizer_config.json").write_text('["<|endoftext|>"]'), r"tokenizer_config.json must hold a JSON object"),
        (lambda d: (d / "tokenizer_config.json").write_text('{"bos_token": 7}'), r"tokenizer_config.json: bos_token must be a token string"),
        (lambda d: (d / "tokenizer_config.json").write_text('{"bos_token": "<nope>"}'), r"tokenizer in .*no '<nope>' token.*tokenizer_config.json"),
    ],
    ids=["config-array", "config-string", "config-nested", "config-not-utf8", "model-type-list", "n-layer-string",
         "n-layer-float", "n-embd-bool", "n-head-null", "eps-string", "scale-false-string",
         "activation-list", "heads-per-layer-object", "n-layer-millions", "n-layer-huge", "index-array",
         "weight-map-list", "no-weight-map", "shard-not-a-name", "shard-outside", "shard-absolute", "shard-missing",
         "tensor-in-two-shards", "int-tensor", "bool-tensor", "float8-tensor", "tokenizer-bad-json",
         "tokenizer-wrong-shape", "tokenizer-array", "tokenizer-config-bad-json", "tokenizer-config-array",
         "tokenizer-config-int-bos", "tokenizer-config-unknown-bos"],
)
def test_hostile_checkpoint_files_get_one_line_errors_naming_the_file(tiny_dir, tmp_path, breakage, match):
    directory = copy_checkpoint(tiny_dir, tmp_path / "broken")
    breakage(directory)
    with pytest.raises(CheckpointError, match=match) as caught:
        HookedDecoder.from_pretrained(directory)
    assert "\n" not in str(caught.value) and str(directory) in str(caught.value)


def test_an_absurd_layer_count_is_refused_before_anything_is_built(tiny_dir, tmp_path, monkeypatch):
    import probe.loading

    directory = copy_checkpoint(tiny_dir, tmp_path / "absurd")
    edit_config(directory, n_layer=10**9)
    built = []
    monkeypatch.setattr(probe.loading, "config_from_hf", lambda *args: built.append(args))
    with pytest.raises(CheckpointError, match="n_layer=1000000000, but the weights hold 2 layers; fix n_layer"):
        HookedDecoder.from_pretrained(directory)
    assert not built  # refused from the files alone, before the config (or any per-layer table) exists


def test_merges_and_vocab_files_of_the_wrong_shape(tiny_dir, tmp_path):
    directory = copy_checkpoint(tiny_dir, tmp_path / "bpe")
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.json").write_text("[1, 2, 3]")
    (directory / "merges.txt").write_text("#version: 0.2\na b\n")
    with pytest.raises(CheckpointError, match=r"vocab.json and .*merges.txt: not a tokenizer"):
        HookedDecoder.from_pretrained(directory)
    (directory / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (directory / "merges.txt").write_text("#version: 0.2\na b c d\nzz\n")
    with pytest.raises(CheckpointError, match=r"merges.txt: not a tokenizer"):
        HookedDecoder.from_pretrained(directory)


@pytest.mark.parametrize("payload", [[torch.zeros(2)], {"wte.weight": [1.0, 2.0]}, {3: torch.zeros(2)}, torch.zeros(3)],
                         ids=["list", "dict-of-lists", "int-keys", "bare-tensor"])
def test_a_bin_that_is_not_a_state_dict_is_named(tiny_dir, tmp_path, payload):
    directory = copy_checkpoint(tiny_dir, tmp_path / "bin")
    (directory / "model.safetensors").unlink()
    torch.save(payload, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin holds a .*, not a mapping of tensor names"):
        HookedDecoder.from_pretrained(directory)


def test_rotary_scaling_and_boolean_entries_of_the_wrong_type_are_named(tmp_path):
    from probe.loading import config_from_hf

    llama = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 vocab_size=100, max_position_embeddings=64)
    cases = [(dict(rope_scaling=["linear", 2.0]), r"rope_scaling must be an object"),
             (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), r"rope_scaling.factor must be a finite number, got the string '2'"),
             (dict(rope_scaling={"rope_type": "linear", "factor": None}), r"rope_scaling.factor must be a finite number, got null"),
             (dict(rope_parameters={"rope_type": 3}), r"rope_parameters.rope_type must be a string, got 3"),
             (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": [1], "high_freq_factor": 4.0}),
              r"rope_parameters.low_freq_factor must be a finite number"),
             (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8.5}),
              r"original_max_position_embeddings must be a positive integer, got 8.5"),
             (dict(rope_theta="10000"), r"rope_theta must be a finite number"),
             (dict(rope_parameters={"rope_type": "linear"}), r"lacks the field 'factor'"),
             # "false" is a true string: refused rather than read as true (or guessed at)
             (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be true or false \(JSON's true/false, unquoted\), got the string 'false'"),
             (dict(attention_bias="0"), r"attention_bias must be true or false"),
             (dict(num_key_value_heads=0), r"num_key_value_heads must be a positive integer, got 0")]
    for extra, match in cases:
        with pytest.raises(CheckpointError, match=match) as caught:
            config_from_hf({**llama, **extra}, tmp_path)
        assert str(tmp_path / "config.json") in str(caught.value)
    assert config_from_hf(llama, tmp_path).rotary_scaling is None  # the well-formed file still reads


def test_a_mixed_dtype_checkpoint_is_cast_at_load_to_the_dtype_holding_all(tiny_dir, tmp_path, tokens):
    mixed = copy_checkpoint(tiny_dir, tmp_path / "mixed")
    edit_weights(mixed, lambda s: s.update({"h.1.mlp.c_fc.weight": s["h.1.mlp.c_fc.weight"].half(),
                                           "h.0.ln_1.weight": s["h.0.ln_1.weight"].bfloat16()}))
    # the oracle: every tensor float32 in the file, the two rounded as the mixed file rounds them
    rounded = copy_checkpoint(tiny_dir, tmp_path / "rounded")
    edit_weights(rounded, lambda s: s.update({"h.1.mlp.c_fc.weight": s["h.1.mlp.c_fc.weight"].half().float(),
                                             "h.0.ln_1.weight": s["h.0.ln_1.weight"].bfloat16().float()}))
    model = HookedDecoder.from_pretrained(mixed)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(model(tokens), HookedDecoder.from_pretrained(rounded)(tokens))


def test_enospc_while_saving_names_the_file(tiny_model, tmp_path, monkeypatch):
    import errno

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("probe.loading.save_file", disk_full)
    with pytest.raises(OSError, match=r"No space left on device.*saved") as caught:
        tiny_model.save_pretrained(tmp_path / "saved")
    assert caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # nothing under the final name, no temporary left


def _sae_files(directory: Path, cfg, state=None) -> Path:
    directory.mkdir()
    (directory / "cfg.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    state = state or {"W_enc": torch.randn(8, 16, generator=gen), "b_enc": torch.zeros(16),
                      "W_dec": torch.randn(16, 8, generator=gen), "b_dec": torch.randn(8, generator=gen)}
    save_file(state, str(directory / "sae_weights.safetensors"))
    return directory


SAE_CFG = {"architecture": "standard", "d_in": 8, "d_sae": 16, "hook_name": "blocks.0.hook_resid_post"}


@pytest.mark.parametrize("cfg,match", [
    ("[1, 2]", r"cfg.json must hold a JSON object of settings, got a list"),
    ("[" * 100_000 + "]" * 100_000, r"cfg.json is nested too deeply"),
    ({**SAE_CFG, "architecture": ["standard"]}, r"cfg.json: architecture must be a string, got \['standard'\]"),
    ({**SAE_CFG, "metadata": ["x"]}, r"cfg.json: metadata must be an object"),
    ({**SAE_CFG, "metadata": {"hook_name": 3}}, r"cfg.json: metadata.hook_name must be a string, got 3"),
    ({**SAE_CFG, "activation_fn_kwargs": [4]}, r"activation_fn_kwargs must be an object"),
    ({**SAE_CFG, "apply_b_dec_to_input": "false"}, r"apply_b_dec_to_input must be true or false \(JSON's, unquoted\), got 'false'"),
    ({**SAE_CFG, "rescale_acts_by_decoder_norm": "no"}, r"rescale_acts_by_decoder_norm must be true or false"),
    ({**SAE_CFG, "d_sae": "16"}, r"cfg.json: d_sae must be a positive int, got '16'"),
], ids=["array", "nested", "architecture-list", "metadata-list", "hook-name-int", "kwargs-list", "b-dec-false-string",
        "rescale-string", "d-sae-string"])
def test_sae_configs_of_the_wrong_shape_are_named(tmp_path, cfg, match):
    from probe import SparseAutoencoder

    with pytest.raises(ValueError, match=match) as caught:
        SparseAutoencoder.from_pretrained(_sae_files(tmp_path / "sae", cfg))
    assert str(tmp_path / "sae" / "cfg.json") in str(caught.value) and "\n" not in str(caught.value)


def test_sae_apply_b_dec_false_is_read_as_false(tmp_path):
    from probe import SparseAutoencoder

    sae = SparseAutoencoder.from_pretrained(_sae_files(tmp_path / "sae", {**SAE_CFG, "apply_b_dec_to_input": False}))
    x = torch.randn(3, 8)
    with torch.no_grad():  # by hand: no b_dec subtracted from the input
        assert torch.allclose(sae.encode(x), torch.relu(x @ sae.W_enc + sae.b_enc))


@pytest.mark.parametrize("bad,match", [
    (lambda s: s["W_dec"].__setitem__((3, 2), float("nan")), r"'W_dec' contains NaN or inf"),
    (lambda s: s["b_enc"].__setitem__(5, float("inf")), r"'b_enc' contains NaN or inf"),
    (lambda s: s.update(b_dec=torch.zeros(8, dtype=torch.int64)), r"'b_dec' is stored as int64"),
], ids=["nan", "inf", "int"])
def test_broken_sae_weights_are_named_at_load_by_file_and_tensor(tmp_path, bad, match):
    from probe import SparseAutoencoder

    gen = torch.Generator().manual_seed(0)
    state = {"W_enc": torch.randn(8, 16, generator=gen), "b_enc": torch.zeros(16),
             "W_dec": torch.randn(16, 8, generator=gen), "b_dec": torch.randn(8, generator=gen)}
    bad(state)
    with pytest.raises(ValueError, match=match) as caught:
        SparseAutoencoder.from_pretrained(_sae_files(tmp_path / "sae", SAE_CFG, state))
    assert "sae_weights.safetensors" in str(caught.value)


@pytest.mark.parametrize("kind", ["gpt2", "openai-gpt"])
def test_gpt_checkpoints_with_an_untied_head_load_and_save_as_transformers_reads_them(tmp_path, kind):
    """tie_word_embeddings=false in a GPT-2 or GPT-1 config.json: transformers keeps lm_head.weight as its own
    matrix; probe must read it (it refused, saying the config ties them) and write it back."""
    import transformers as tf

    cls, config = {"gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=24,
                                                               tie_word_embeddings=False)),
                   "openai-gpt": (tf.OpenAIGPTLMHeadModel, tf.OpenAIGPTConfig(vocab_size=50, n_embd=32, n_layer=2, n_head=4,
                                                                              n_positions=24, tie_word_embeddings=False))}[kind]
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape))
    model.save_pretrained(tmp_path / "hf")
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    assert not torch.equal(hf.lm_head.weight, hf.get_input_embeddings().weight)  # transformers kept it untied
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = HookedDecoder.from_pretrained(tmp_path / "hf").eval()
    assert not ours.cfg.tied_embeddings
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)
        again = cls.from_pretrained(ours.save_pretrained(tmp_path / "saved")).eval()
        torch.testing.assert_close(again(tokens).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("files", ["llama", "qwen"])
def test_a_saved_model_reloads_with_its_tokenizers_bos_eos_padding_and_chat_template(files, tmp_path):
    """model.save_pretrained writes tokenizer_config.json beside tokenizer.json: a tokenizer whose BOS only the config
    names (Llama's <s>, Llama 3's <|begin_of_text|>) or that adds none (Qwen's) tokenizes the same after a reload, and
    transformers' own AutoTokenizer reads the saved files to the same ids."""
    import transformers as tf

    from test_family_defaults import LLAMA_FILES, QWEN_FILES, tokenized_checkpoint

    directory = tokenized_checkpoint("llama" if files == "llama" else "qwen2", tmp_path / "checkpoint",
                                     LLAMA_FILES if files == "llama" else QWEN_FILES)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_path.write_text(json.dumps(config))
    model = HookedDecoder.from_pretrained(directory)
    again = HookedDecoder.from_pretrained(model.save_pretrained(tmp_path / "saved"))
    texts = ["Hello there", "a second, longer text"]
    assert again.to_tokens(texts).tolist() == model.to_tokens(texts).tolist()
    for what in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template"):
        assert getattr(again.tokenizer, what) == getattr(model.tokenizer, what), what
    assert (model.to_tokens("Hello")[0, 0] == model.tokenizer.bos_token_id) == (files == "llama")
    theirs = tf.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert theirs("Hello there")["input_ids"] == model.to_tokens("Hello there")[0].tolist()
