"""transformer-lens 3.9 code that still failed on probe: every HookedTransformerConfig field read on `model.cfg`
(probe/tl_config_fields.py), `act_fn="gelu_fast"` (and TL's other names for the tanh GELU), and `generate` from
input embeddings (probe/generation.py).

The oracle is HookedTransformer itself (transformer-lens 3.9, in the SAELens virtualenv: tests/saelens_oracle.py's
`tl_config_cases`, one call for the file), built from the same keywords: its config's values, the field list taken
from its dataclass at test time, its logits on its own weights (moved off their initialisation), its `gelu_fast`,
and its greedy `generate`; where probe deliberately reads a field otherwise, `transformers` or a count by hand."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, processors

from probe import DEFAULT_MODEL, HookedDecoder, HookedTransformerConfig
from probe.config import SWITCHES
from test_sae_training import needs_saelens, oracle

SMALL = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50)
NO_EOS = dict(stop_at_eos=False, max_new_tokens=6)  # no tokenizer: nothing to stop at
CASES = {
    # learned positions; seed= read back; TL's kv-cached generate from embeddings gets their positions wrong (see
    # test_generate_from_embeddings_...), so its cache-free run is the reference, and its run from the ids
    "gelu-fast-seeded": dict(config=dict(SMALL, act_fn="gelu_fast", seed=7), generate=[
        dict(NO_EOS, use_past_kv_cache=False), dict(NO_EOS, use_past_kv_cache=False, **{"from": "tokens"}),
        dict(NO_EOS, use_past_kv_cache=False, return_type="tokens")]),
    # NTK-by-parts rope with a short original context (so it changes the frequencies), grouped-query heads: TL's
    # rotary generate is right with its cache too
    "rms-rotary-gqa-gated-ntk": dict(config=dict(
        SMALL, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", n_key_value_heads=2,
        gated_mlp=True, final_rms=True, d_mlp=48, rotary_base=100, use_NTK_by_parts_rope=True, NTK_by_parts_factor=4.0,
        NTK_by_parts_low_freq_factor=1.0, NTK_by_parts_high_freq_factor=2.0, NTK_original_ctx_len=8),
        generate=[dict(NO_EOS, use_past_kv_cache=True), dict(NO_EOS, return_type="tokens")]),
    "rotary-linear-scaling-pytorch-tanh": dict(config=dict(
        SMALL, act_fn="gelu_pytorch_tanh", positional_embedding_type="rotary", rotary_scaling_factor=4.0)),
    # Gemma 3's rotary: local layers by their own base and unscaled, global ones by rotary_base rescaled; and TL's
    # linear rescaling skipping the local layers without a local base
    "rotary-local-base-global-scaling": dict(config=dict(
        SMALL, act_fn="relu", positional_embedding_type="rotary", use_local_attn=True, window_size=4,
        attn_types=["local", "global"], rotary_base=1000000, rotary_base_local=100, rotary_scaling_factor=8.0)),
    "rotary-local-layers-unscaled": dict(config=dict(
        SMALL, act_fn="relu", positional_embedding_type="rotary", use_local_attn=True, window_size=4,
        attn_types=["global", "local"], rotary_base=100, rotary_scaling_factor=4.0)),
    # GPT-J's pairing: dimension 2i rotates with 2i + 1, on part of each head
    "rotary-adjacent-pairs": dict(config=dict(
        SMALL, act_fn="gelu_new", positional_embedding_type="rotary", rotary_adjacent_pairs=True, rotary_dim=4,
        rotary_base=100)),
    # YaRN: frequencies ramped between interpolated and kept, q and k scaled by its attention factor; on every layer,
    # and with yarn_global_attn_only the local layer rotating unscaled
    "rotary-yarn": dict(config=dict(
        SMALL, act_fn="silu", positional_embedding_type="rotary", rotary_base=100, use_yarn_rope=True, yarn_factor=4.0,
        yarn_attention_factor=1.2, yarn_beta_fast=8.0, yarn_beta_slow=1.0, yarn_original_max_position_embeddings=4)),
    "rotary-yarn-global-only": dict(config=dict(
        SMALL, act_fn="silu", positional_embedding_type="rotary", rotary_base=100, use_yarn_rope=True, yarn_factor=4.0,
        yarn_attention_factor=1.2, yarn_original_max_position_embeddings=4, yarn_truncate=False,
        yarn_global_attn_only=True, use_local_attn=True, window_size=4, attn_types=["local", "global"])),
    # a tokenizer that puts BOS first by itself (as Llama's tokenizer.json does): TL and probe both load it
    "attn-only-shortformer-bos-tokenizer": dict(config=dict(
        SMALL, d_vocab=4096, attn_only=True, positional_embedding_type="shortformer", tokenizer_name="BOS_TOKENIZER"),
        generate=[dict(max_new_tokens=5, use_past_kv_cache=False), dict(max_new_tokens=5, use_past_kv_cache=False,
                                                                       return_type="str")]),
    # GPT-2's tokenizer, local attention, tied embeddings (fields only: TL's HookedTransformer does not tie them)
    "local-tied-gpt2-tokenizer": dict(config=dict(
        SMALL, d_vocab=4096, act_fn="relu", use_local_attn=True, window_size=4, attn_types=["global", "local"],
        tie_word_embeddings=True, tokenizer_name=str(DEFAULT_MODEL), original_architecture="GPT2LMHeadModel")),
}
WITH_TL_WEIGHTS = [case for case, spec in CASES.items() if not spec["config"].get("tie_word_embeddings")]


def bos_tokenizer(directory) -> str:
    """The bundled tokenizer with a post-processor that puts BOS first, as a Llama tokenizer.json's does."""
    directory.mkdir()
    tokenizer = Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": bos, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return str(directory)


@pytest.fixture(scope="module")
def hooked_transformers(tmp_path_factory):
    """(the configs as given to both libraries, the oracle's tensors, its printed JSON, the prompt tokens, x)."""
    tmp = tmp_path_factory.mktemp("tl_config_cases")
    bos_dir = bos_tokenizer(tmp / "bos_tokenizer")
    configs = {name: {k: bos_dir if v == "BOS_TOKENIZER" else v for k, v in spec["config"].items()}
               for name, spec in CASES.items()}
    tokens = torch.randint(0, SMALL["d_vocab"], (2, 5), generator=torch.Generator().manual_seed(3))
    x = torch.linspace(-10, 10, 4001)
    save_file({"tokens": tokens, "x": x}, str(tmp / "inputs.safetensors"))
    cases = {name: {"config": configs[name], "generate": spec.get("generate", [])} for name, spec in CASES.items()}
    printed = oracle("tl_config_cases", json.dumps(cases), tmp / "inputs.safetensors", tmp / "out.safetensors")
    return configs, load_file(str(tmp / "out.safetensors")), json.loads(printed.splitlines()[-1]), tokens, x


def part(out: dict, prefix: str) -> dict:
    return {key.removeprefix(prefix): t for key, t in out.items() if key.startswith(prefix)}


def probe_model(configs: dict, out: dict, case: str) -> HookedDecoder:
    model = HookedDecoder(HookedTransformerConfig(**configs[case])).eval()
    if case in WITH_TL_WEIGHTS:
        model.load_state_dict(part(out, f"{case}/state."), strict=True)
    return model


def comparable(value):
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def n_params_by_hand(cfg: dict) -> int:
    """The weights of attention (W_Q and W_O per query head, W_K and W_V per key/value head) and of the MLPs."""
    kv = cfg.get("n_key_value_heads") or cfg["d_model"] // cfg["d_head"]
    attention = cfg["d_model"] * cfg["d_head"] * (2 * (cfg["d_model"] // cfg["d_head"]) + 2 * kv)
    mlp = 0 if cfg.get("attn_only") else cfg["d_model"] * cfg.get("d_mlp", 4 * cfg["d_model"]) * (3 if cfg.get("gated_mlp") else 2)
    return cfg["n_layers"] * (attention + mlp)


def deliberate_exception(case: str, field: str, configs: dict, model: HookedDecoder):
    """For a field probe reads otherwise than HookedTransformer, the value an independent oracle gives, and why;
    None where probe reads TL's value."""
    config = configs[case]
    if field == "n_params" and config.get("n_key_value_heads"):
        # TL counts W_K and W_V once per query head, though its grouped-query model holds one per key/value head
        return n_params_by_hand(config), "TL's count ignores grouped key/value heads"
    if field == "uses_rms_norm" and str(config.get("normalization_type")).startswith("RMS"):
        # a HookedTransformer never sets it (its normalization_type says RMS); TL 4's bridge sets it for RMSNorm
        return True, "the bridge's meaning: the model's norms are RMSNorms"
    return None


@needs_saelens
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_hooked_transformer_config_field_reads_as_tl_reads_it(case, hooked_transformers):
    configs, out, printed, _, _ = hooked_transformers
    theirs = printed[case]
    model = probe_model(configs, out, case)
    fields = printed["fields"]
    assert len(fields) > 80 and set(fields) == set(theirs)  # TL 3.9's whole dataclass, as the oracle read it
    missing = [field for field in fields if not hasattr(model.cfg, field)]
    assert missing == []
    for field in fields:
        ours = comparable(getattr(model.cfg, field))
        exception = deliberate_exception(case, field, configs, model)
        expected = theirs[field] if exception is None else exception[0]
        if isinstance(expected, float) and not isinstance(ours, bool):
            assert ours == pytest.approx(expected), field
        else:
            assert ours == expected, (field, exception and exception[1])


@needs_saelens
def test_a_tl_config_dict_with_every_field_rebuilds_the_same_model(hooked_transformers):
    """HookedTransformerConfig(**saved_cfg_dict), a TL 3.9 config's whole to_dict() (every field, TL's defaults for
    the features probe lacks), builds probe's config from the same keywords, and its fields read back alike."""
    configs, out, printed, _, _ = hooked_transformers
    for case in WITH_TL_WEIGHTS:
        theirs = dict(printed[case])
        theirs["dtype"] = theirs["dtype"].removeprefix("torch.")
        rebuilt = HookedTransformerConfig(**theirs)
        assert rebuilt == HookedTransformerConfig(**configs[case]), case
        assert rebuilt.act_fn == theirs["act_fn"] and rebuilt.seed == theirs["seed"], case


@needs_saelens
def test_to_dict_holds_what_tl_code_reads_by_tls_names(hooked_transformers):
    """circuit-tracer 0.5 builds its graph's config from `model.cfg.to_dict()`, reading n_key_value_heads,
    tokenizer_name, model_name, original_architecture and dtype: the values TL 3.9's to_dict() holds for the same
    config; and the dict still rebuilds the config it came from."""
    read = ("n_key_value_heads", "tokenizer_name", "model_name", "original_architecture", "dtype")
    configs, _, printed, _, _ = hooked_transformers
    for case in WITH_TL_WEIGHTS:
        ours = HookedDecoder(HookedTransformerConfig(**configs[case])).cfg
        listed = ours.to_dict()
        theirs = {**printed[case], "dtype": printed[case]["dtype"].removeprefix("torch.")}
        assert {name: listed.get(name, "absent") for name in read} == {name: theirs[name] for name in read}, case
        assert HookedTransformerConfig(**listed) == ours, case


@needs_saelens
def test_gelu_fast_is_tls_and_reads_back(hooked_transformers):
    """act_fn="gelu_fast": TL's formula (constant 0.7978845608, the tanh form) is the tanh GELU probe computes, to
    float32 precision over [-10, 10]; a model of it gives TL's logits on TL's weights, and cfg.act_fn says "gelu_fast"."""
    configs, out, printed, tokens, x = hooked_transformers
    model = probe_model(configs, out, "gelu-fast-seeded")
    torch.testing.assert_close(model.blocks[0].mlp.act_fn(x), out["gelu_fast"], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), out["gelu-fast-seeded/logits"], atol=1e-4, rtol=1e-4)
    assert model.cfg.act_fn == printed["gelu-fast-seeded"]["act_fn"] == "gelu_fast"
    assert model.cfg.activation.value == "gelu_new"  # one function: saved checkpoints and comparisons see gelu_new


@needs_saelens
@pytest.mark.parametrize("case", ["rms-rotary-gqa-gated-ntk", "rotary-linear-scaling-pytorch-tanh",
                                  "attn-only-shortformer-bos-tokenizer", "rotary-local-base-global-scaling",
                                  "rotary-local-layers-unscaled", "rotary-adjacent-pairs", "rotary-yarn",
                                  "rotary-yarn-global-only"])
def test_other_tl_settings_give_tls_logits(case, hooked_transformers):
    """NTK-by-parts rope, linear rope scaling (rotary_scaling_factor), gelu_pytorch_tanh, a shortformer model with a
    tokenizer, local layers' own rotary base: TL's logits on TL's weights."""
    configs, out, printed, tokens, _ = hooked_transformers
    model = probe_model(configs, out, case)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), out[f"{case}/logits"], atol=1e-4, rtol=1e-4)
    assert model.cfg.act_fn == printed[case]["act_fn"]


@needs_saelens
@pytest.mark.parametrize("case", [case for case in sorted(CASES) if CASES[case].get("generate")])
def test_generate_from_embeddings_is_hooked_transformers(case, hooked_transformers):
    """TL's `model.generate(model.embed(tokens), do_sample=False)`: the same embeddings (positions not added) give
    TL's output, embeddings [batch pos+new d_model] by default, the new tokens alone for return_type="tokens", the
    new text for "str"; with probe's key/value cache on and off. TL's from-ids run continues the same way."""
    configs, out, printed, tokens, _ = hooked_transformers
    model = probe_model(configs, out, case)
    embeds = model.embed(tokens)
    for i, keywords in enumerate(CASES[case]["generate"]):
        keywords = dict(keywords)
        prompt = tokens if keywords.pop("from", "embeds") == "tokens" else embeds
        theirs = printed["text"].get(f"{case}/generate.{i}", out.get(f"{case}/generate.{i}"))
        for use_cache in (True, False):
            ours = model.generate(prompt, do_sample=False, **{**keywords, "use_past_kv_cache": use_cache})
            if isinstance(theirs, torch.Tensor) and theirs.is_floating_point():
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=f"{i} {use_cache}")
            elif isinstance(theirs, torch.Tensor):
                assert ours.tolist() == theirs.tolist(), (i, use_cache)
            else:
                assert ours == theirs, (i, use_cache)


@needs_saelens
def test_generate_from_embeddings_with_learned_positions_continues_as_full_forwards_do(hooked_transformers):
    """Why TL's cache-free run is the reference for learned positions: TL 3.9's cached run offsets the whole
    sequence's positions by the cache's length at each new token, so its continuation is not the prompt's. By hand:
    greedy continuation of the ids with every step a full forward, which probe's (cached) generate equals."""
    configs, out, _, tokens, _ = hooked_transformers
    model = probe_model(configs, out, "gelu-fast-seeded")
    sequence = tokens
    with torch.no_grad():
        for _ in range(6):
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
    ours = model.generate(model.embed(tokens), max_new_tokens=6, stop_at_eos=False, return_type="tokens")
    assert ours.tolist() == sequence[:, tokens.shape[1]:].tolist()


def test_generate_refuses_misshapen_embeddings_and_token_only_keywords():
    model = HookedDecoder(HookedTransformerConfig(**SMALL, act_fn="relu", seed=0)).eval()
    for bad in (torch.randn(5, 32), torch.randn(2, 5, 31), torch.randn(2, 0, 32), torch.randn(1, 2, 5, 32)):
        with pytest.raises(ValueError, match=r"float \[batch pos d_model\] tensor with d_model=32.*got shape"):
            model.generate(bad, max_new_tokens=2, stop_at_eos=False)
    embeds = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="padding_side='left' reads the padding off pad token ids.*attention_mask="):
        model.generate(embeds, max_new_tokens=2, stop_at_eos=False, padding_side="left")
    with pytest.raises(ValueError, match="freq_penalty=1.0 counts earlier token ids"):
        model.generate(embeds, max_new_tokens=2, stop_at_eos=False, do_sample=True, freq_penalty=1.0)
    with pytest.raises(ValueError, match="would exceed n_ctx=16"):
        model.generate(torch.randn(1, 12, 32), max_new_tokens=5, stop_at_eos=False)


def test_left_padded_embeddings_continue_as_each_prompt_alone():
    """An attention_mask marks left padding among embeddings: each prompt continues as it does unpadded (by hand:
    the prompt run alone)."""
    model = HookedDecoder(HookedTransformerConfig(**SMALL, act_fn="relu", seed=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    short, long = torch.randn(1, 3, 32), torch.randn(1, 5, 32)
    padded = torch.cat([torch.cat([torch.zeros(1, 2, 32), short], 1), long])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    both = model.generate(padded, max_new_tokens=4, stop_at_eos=False, attention_mask=mask, return_type="tokens")
    for row, alone in enumerate((short, long)):
        assert both[row].tolist() == model.generate(alone, max_new_tokens=4, stop_at_eos=False, return_type="tokens")[0].tolist()


def test_a_tokenizer_records_whether_it_puts_bos_first(tmp_path):
    """cfg.tokenizer_prepends_bos follows the model's tokenizer, as TL's set_tokenizer sets it: transformers'
    tokenizer of the same files, reloaded with add_bos_token=True as TL reloads it, called on "", says whether one is
    put first by itself."""
    import transformers

    bos_dir = bos_tokenizer(tmp_path / "bos")
    model = HookedDecoder(HookedTransformerConfig(**SMALL, act_fn="relu"))
    assert model.cfg.tokenizer_prepends_bos is None  # no tokenizer, as TL's None
    for directory in (bos_dir, str(DEFAULT_MODEL)):
        expected = len(transformers.AutoTokenizer.from_pretrained(directory, add_bos_token=True)("")["input_ids"]) > 0
        model.set_tokenizer(transformers.AutoTokenizer.from_pretrained(directory))
        assert model.cfg.tokenizer_prepends_bos is expected
        built = HookedDecoder(HookedTransformerConfig(**dict(SMALL, d_vocab=4096), act_fn="relu", tokenizer_name=directory))
        assert built.cfg.tokenizer_prepends_bos is expected
    assert HookedDecoder.from_pretrained(DEFAULT_MODEL).cfg.tokenizer_prepends_bos is True  # as TL's GPT-2


def test_checkpoint_fields_follow_checkpoint_value(monkeypatch, tmp_path):
    """from_pretrained(name, checkpoint_value=step) records TL's from_checkpoint, checkpoint_value,
    checkpoint_label_type and checkpoint_index (the step's place in TL's list: Pythia's 154 steps, 0, 1, 2, 4, ...,
    512, then every 1000th to 143000, so step 3000 is the 14th, index 13); a step not saved is refused."""
    import shutil

    import huggingface_hub

    def snapshot_download(repo_id, revision=None, **_):  # the bundled model's files stand in for the hub's
        target = tmp_path / f"{repo_id.replace('/', '--')}-{revision}"
        if not target.exists():
            shutil.copytree(DEFAULT_MODEL, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    plain = HookedDecoder.from_pretrained(DEFAULT_MODEL).cfg
    assert (plain.from_checkpoint, plain.checkpoint_value, plain.checkpoint_index, plain.checkpoint_label_type) == (
        False, None, None, None)
    cfg = HookedDecoder.from_pretrained("EleutherAI/pythia-70m", checkpoint_value=3000).cfg
    early = [0] + [2 ** i for i in range(10)]
    assert (cfg.from_checkpoint, cfg.checkpoint_value, cfg.checkpoint_label_type) == (True, 3000, "step")
    assert cfg.checkpoint_index == len(early) + 3000 // 1000 - 1
    with pytest.raises(ValueError, match="no checkpoint at step 3001; the nearest are 3000 and 4000"):
        HookedDecoder.from_pretrained("EleutherAI/pythia-70m", checkpoint_value=3001)
    assert math.isclose(plain.rotary_scaling_factor, 1.0) and plain.n_devices == 1


@pytest.mark.parametrize("settings, match", [
    (dict(rotary_scaling_factor=4.0, use_NTK_by_parts_rope=True), r"rotary_scaling_factor=4.0.*use_NTK_by_parts_rope"),
    (dict(use_dynamic_ntk_rope=True), r"use_dynamic_ntk_rope=True\) is not supported"),
    (dict(use_logn_attn=True), r"use_logn_attn=True\) is not supported"),
    (dict(load_in_4bit=True), r"load_in_4bit=True\) is not supported"),
    (dict(original_architecture="Olmo2ForCausalLM"), r"original_architecture='Olmo2ForCausalLM'\) is not supported"),
])
def test_tl_features_probe_lacks_are_refused_by_name(settings, match):
    """TL 3.9's settings for features probe's decoder does not build are refused at any value but their off one,
    so a config never reads back a feature the model lacks."""
    with pytest.raises(ValueError, match=match):
        HookedTransformerConfig(**dict(SMALL, act_fn="relu", positional_embedding_type="rotary"), **settings)


INIT_CASES = {  # TL's "gpt2" init on learned, shortformer attention-only, rotary GQA gated, SoLU-LN and parallel toys
    "learned": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu"),
    "shortformer": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="relu", attn_only=True,
                        normalization_type=None, positional_embedding_type="shortformer", seed=398),
    "gqa": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu", normalization_type="RMS",
                gated_mlp=True, n_key_value_heads=2, positional_embedding_type="rotary", rotary_dim=8, seed=3),
    "solu_ln": dict(n_layers=1, d_model=32, d_head=8, n_ctx=16, d_vocab=50, d_vocab_out=20, act_fn="solu_ln",
                    normalization_type="LNPre", initializer_range=0.05),
    "parallel": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu", parallel_attn_mlp=True,
                     positional_embedding_type="rotary", rotary_dim=4, seed=0),
    # GPT-OSS's: sinks (TL leaves them at zero) and biased experts chosen by logit
    "gpt_oss": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu", normalization_type="RMS",
                    n_key_value_heads=2, positional_embedding_type="rotary", rotary_dim=8, num_experts=3,
                    experts_per_token=2, use_attention_sinks=True, original_architecture="GptOssForCausalLM", seed=1),
    # Apertus's: each MLP's xIELU holds two parameters TL initialises (no draws)
    "xielu": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="xielu", normalization_type="RMS",
                  positional_embedding_type="rotary", rotary_dim=8, use_qk_norm=True,
                  original_architecture="ApertusForCausalLM", seed=2),
    "moe": dict(n_layers=1, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="silu", normalization_type="RMS",
                num_experts=3, experts_per_token=1, positional_embedding_type="rotary", rotary_dim=8),
    # No_Position_Experiment's analysis model, built to load a state dict into: nothing drawn (TL's weights are
    # torch.empty's, whatever memory held; probe's zeros, norms' ones)
    "no_init": dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="relu", normalization_type="LNPre",
                    init_weights=False, seed=5),
}


@needs_saelens
def test_a_model_built_from_a_tl_config_draws_hookedtransformers_weights_and_leaves_its_generator_state(tmp_path):
    # ARENA's notebooks seed, build HookedTransformer(cfg), then draw random tokens: the same tokens need the same
    # draws in the same order. The oracle: HookedTransformer (transformer-lens 3.9) built from each config
    oracle("tl_init", json.dumps(INIT_CASES), tmp_path / "tl.safetensors")
    theirs = load_file(tmp_path / "tl.safetensors")
    for name, config in INIT_CASES.items():
        cfg = HookedTransformerConfig(**config)
        torch.manual_seed(11)
        model = HookedDecoder(cfg)
        assert torch.equal(torch.randint(0, 1000, (8,)), theirs[f"{name}/next"]), name
        ours = model.state_dict()
        if not config.get("init_weights", True):
            assert all(not p.any() for key, p in model.named_parameters() if not key.endswith(".w")), name
            continue
        keys = [key.split("/", 1)[1] for key in theirs if key.startswith(f"{name}/") and not key.endswith("/next")]
        weights = [key for key in keys if key in ours]  # TL's buffers (mask, IGNORE, rotary tables) are not weights
        assert sorted(weights) == sorted(ours), name
        for key in weights:
            assert torch.equal(ours[key], theirs[f"{name}/{key}"]), f"{name}: {key}"


@needs_saelens
def test_a_model_built_from_a_config_dict_or_tls_config_object_is_hookedtransformers(tmp_path):
    """TL code hands HookedTransformer(cfg) a dict of HookedTransformerConfig's keywords, or TL's own config object
    (ACDC builds its models both ways): probe's HookedDecoder takes both and draws TL's weights. The oracle:
    HookedTransformer (transformer-lens 3.9) given each; TL's object exists only in its environment, so probe is given
    it there (`tl_config_routes`). TL's cfg.to_dict() lists the use_* switches, whose keys TL code tests (ACDC turns
    hook_mlp_in on only where "use_hook_mlp_in" is in it), and probe's lists them with their values too."""
    cases = {name: INIT_CASES[name] for name in ("learned", "gqa")}
    switches = json.loads(oracle("tl_config_routes", json.dumps(cases), tmp_path / "tl.safetensors"))
    theirs = load_file(tmp_path / "tl.safetensors")
    for name, config in cases.items():
        torch.manual_seed(11)
        model = HookedDecoder(dict(config))
        next_draw = torch.randint(0, 1000, (8,))
        ours = {"probe_dict": (model.state_dict(), next_draw)}
        ours["probe_object"] = ({key.split("/", 2)[2]: t for key, t in theirs.items()
                                 if key.startswith(f"{name}/probe_object/") and not key.endswith("/next")},
                                theirs[f"{name}/probe_object/next"])
        for route, tl_route in (("probe_dict", "tl_dict"), ("probe_object", "tl_object")):
            state, draw = ours[route]
            assert torch.equal(draw, theirs[f"{name}/{tl_route}/next"]), (name, route)
            assert state and all(torch.equal(t, theirs[f"{name}/{tl_route}/{key}"]) for key, t in state.items()), (name, route)
        assert set(switches[name]) >= set(SWITCHES)
        listed = model.cfg.to_dict()
        assert {key: listed[key] for key in SWITCHES} == {key: switches[name][key] for key in SWITCHES}
        model.set_use_hook_mlp_in(True)
        assert model.cfg.to_dict()["use_hook_mlp_in"] is True
        assert HookedTransformerConfig(**model.cfg.to_dict()).use_hook_mlp_in  # TL code's clone keeps the switch
    with pytest.raises(TypeError, match="takes a DecoderConfig, transformer-lens's HookedTransformerConfig or a dict"):
        HookedDecoder(["n_layers", 2])
