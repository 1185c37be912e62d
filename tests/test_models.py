"""Our paged Llama / OPT decoders against transformers on random-weight models (float32, CPU): the same logits from
a transformers object and from a saved checkpoint (safetensors and .bin), for each architecture variant; a prefill
over cached context (a block-table gather with a causal offset) equals the full prefill.
"""
from __future__ import annotations

import os
from unittest.mock import patch

import pytest
import torch

from pagedattn import kernels
from pagedattn.executor import ModelRunner
from pagedattn.memory.per_sequence import PerSequence
from pagedattn.model import load_model
from pagedattn.scheduler import SchedulerOutputs, lay_out
from pagedattn.sequence import SamplingParams, Sequence, SequenceGroup
from factories import block_manager
from tiny_models import tiny_llama, tiny_opt


PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 1, 42], [11], list(range(40, 77)), [200, 100, 50, 25, 12, 6]]


def hf_last_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def paged_last_logits(model, prompts: list[list[int]], block_size: int = 4, split: int | None = None):
    """Prefill all prompts in one flat batch through a ModelRunner; with ``split``, each prompt's first ``split``
    tokens are computed first and the rest in a second prefill over the cached context."""
    bm = block_manager(block_size, 64)
    per_seq = PerSequence(bm)
    runner = ModelRunner(model, bm.cache_layout(), kernels.get_backend("torch"), torch.device("cpu"), torch.float32)
    groups = []
    for i, p in enumerate(prompts):
        first = p[:split] if split else p
        s = Sequence(i, first)
        per_seq.allocate(i, len(first))
        s.status = "running"
        groups.append(SequenceGroup(str(i), [s], SamplingParams()))
    if split:
        logits, _ = runner.forward(runner.prepare_input(lay_out(SchedulerOutputs(prefill_groups=groups), bm)))
        for g, p in zip(groups, prompts):
            s = g.seqs[0]
            s.num_computed_tokens = s.get_len()
            for t in p[split:]:
                s.append_token(t)
                per_seq.append_slot(s.seq_id)
    logits, _ = runner.forward(runner.prepare_input(lay_out(SchedulerOutputs(prefill_groups=groups), bm)))
    return logits


VARIANTS = {
    "llama_gqa": lambda: tiny_llama(),
    "llama_mha_tied": lambda: tiny_llama(num_key_value_heads=4, tie_word_embeddings=True),
    "opt": lambda: tiny_opt(),
    "opt_post_ln": lambda: tiny_opt(do_layer_norm_before=False),
    "opt_project_in_out": lambda: tiny_opt(word_embed_proj_dim=32),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_hf(name, prefill_path):
    hf = VARIANTS[name]()
    model = load_model(hf)
    got = paged_last_logits(model, PROMPTS)
    for row, p in zip(got, PROMPTS):
        torch.testing.assert_close(row, hf_last_logits(hf, p), rtol=1e-4, atol=1e-4)


def tiny_llama_rope(rope: dict):
    try:
        return tiny_llama(rope_parameters={"rope_theta": 10000.0, **rope})
    except TypeError:  # transformers 4.x names it rope_scaling
        return tiny_llama(rope_scaling=rope)


ROPES = {  # original_max_position_embeddings = 32: the 37-token prompt runs past it
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # = default up to max_position_embeddings (max_model_len)
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_types_match_hf(name):
    hf = tiny_llama_rope(ROPES[name])
    got = paged_last_logits(load_model(hf), PROMPTS[2:3])
    torch.testing.assert_close(got[0], hf_last_logits(hf, PROMPTS[2]), rtol=1e-4, atol=1e-4)


def test_longrope_is_refused_at_load_time():
    """transformers picks longrope's short or long factors per forward call (by the largest position in it), so
    cached K/V would depend on how a sequence was split into calls: refused, naming the rope type."""
    half = 8  # head_dim 16 / 2
    hf = tiny_llama_rope({"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half,
                          "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        load_model(hf)


@pytest.fixture(params=[False, True], ids=["per_sequence", "batched"])
def prefill_path(request, monkeypatch):
    """Both prefill paths on the CPU: one SDPA call per sequence (the CPU's) and the batched call (a GPU's)."""
    from pagedattn.model import attention

    monkeypatch.setattr(attention, "BATCHED_PREFILL", request.param)
    return request.param


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_prefill_over_cached_context(make, prefill_path):
    """Prefill the tail of each prompt over its cached head (the path prefix caching and chunked prefill use)."""
    hf = make()
    model = load_model(hf)
    prompts = [p for p in PROMPTS if len(p) > 5]
    got = paged_last_logits(model, prompts, split=5)
    for row, p in zip(got, prompts):
        torch.testing.assert_close(row, hf_last_logits(hf, p), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_load_from_checkpoint_folder(tmp_path, make, safe):
    hf = make()
    if safe:
        hf.save_pretrained(tmp_path)
    else:  # transformers 5 always writes safetensors: write the legacy PyTorch file by hand
        hf.config.save_pretrained(tmp_path)
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert any(tmp_path.glob("*.safetensors" if safe else "*.bin"))
    model = load_model(tmp_path, dtype=torch.float32)
    got = paged_last_logits(model, PROMPTS)
    for row, p in zip(got, PROMPTS):
        torch.testing.assert_close(row, hf_last_logits(hf, p), rtol=1e-4, atol=1e-4)


def test_dtype_and_unknown_model_type():
    hf = tiny_opt()
    assert next(load_model(hf, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    hf.config.model_type = "gpt_bigcode"
    with pytest.raises(ValueError, match="not supported"):
        load_model(hf)


def test_fused_qkv_follows_its_layers_weights():
    """The fused q/k/v projection equals the three layers, keeps their parameter names (views, no extra memory),
    and follows a weight that is changed in place or replaced (``.to``) afterwards."""
    from pagedattn.model.fused import FusedLinear

    torch.manual_seed(3)
    layers = [torch.nn.Linear(16, n, bias=True) for n in (16, 8, 8)]
    fused = FusedLinear(*layers)
    x = torch.randn(5, 16)

    def separate(x):
        return torch.cat([m(x) for m in layers], -1)
    torch.testing.assert_close(fused(x), separate(x), rtol=0, atol=1e-6)
    assert layers[1].weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        layers[2].weight.mul_(2.0)  # in place, through the view
        layers[0].bias.copy_(torch.randn(16))
    torch.testing.assert_close(fused(x), separate(x), rtol=0, atol=1e-6)
    for m in layers:
        m.to(torch.float64)  # replaces the parameters' data
    assert fused(x.double()).dtype == torch.float64
    torch.testing.assert_close(fused(x.double()), separate(x.double()), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one input size"):
        FusedLinear(torch.nn.Linear(4, 4), torch.nn.Linear(5, 4))


def test_fp32_linear_takes_mkl_on_intel_and_onednn_elsewhere(monkeypatch):
    """``fused.linear`` sends fp32 CPU inputs of ``ONEDNN_MIN_ROWS`` rows or more to oneDNN only on a CPU that is not
    Intel's (where MKL was measured faster), and whichever it takes, each output is the same dot product to a few
    fp32 ulps."""
    from pagedattn import cpuinfo
    from pagedattn.model import fused

    assert cpuinfo.intel_cpu("GenuineIntel") and not cpuinfo.intel_cpu("AuthenticAMD")
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        pytest.skip("no oneDNN in this torch")
    assert fused._ONEDNN == (not cpuinfo.intel_cpu())
    torch.manual_seed(4)
    x, w = torch.randn(fused.ONEDNN_MIN_ROWS, 32), torch.randn(48, 32)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, w)
        for onednn in (True, False):
            monkeypatch.setattr(fused, "_ONEDNN", onednn)
            got = fused.linear(x, w)
            if not onednn:
                assert torch.equal(got, ref)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_bf16_linear_packs_its_weight_once_and_equals_f_linear():
    """On a CPU with bf16 hardware, a bf16 ``Linear`` (and a ``FusedLinear``) multiplies by a oneDNN-packed copy of
    its weight: outputs equal ``F.linear``'s bit for bit at 1-300 rows, with or without a bias, for a weight stored
    ``[in, out]``; the copy is made once, remade after the weight changes in place, and a deep copy or pickle of the
    layer starts without it. Elsewhere (no bf16 hardware, fp32, autograd on) the layer takes ``F.linear``."""
    import copy
    import pickle

    import torch.nn.functional as F

    from pagedattn import cpuinfo
    from pagedattn.model import fused

    if not fused._PACKED_BF16:
        assert not (cpuinfo.bf16_in_hardware() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
        pytest.skip("no bf16 hardware or no oneDNN reorder op here")
    torch.manual_seed(5)
    for bias in (True, False):
        layer = fused.Linear(96, 80, bias=bias).to(torch.bfloat16)
        with torch.no_grad():
            layer.weight.data = layer.weight.t().contiguous().t()  # [in, out] memory, as the loader stores it
        with torch.inference_mode():
            for rows in (1, 7, 64, 300):
                x = torch.randn(rows, 96).to(torch.bfloat16)
                assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), (bias, rows)
            packed = layer.packed.tensor
            assert packed is not None and packed.is_mkldnn
            layer(x)
            assert layer.packed.tensor is packed  # made once
        with torch.no_grad():
            layer.weight.mul_(2)
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and layer.packed.tensor is not packed
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone.packed.tensor is None and torch.equal(clone.weight, layer.weight)
    a, b = fused.Linear(96, 32).to(torch.bfloat16), fused.Linear(96, 16).to(torch.bfloat16)
    both = fused.FusedLinear(a, b)
    with torch.inference_mode():
        assert torch.equal(both(x), torch.cat([F.linear(x, a.weight, a.bias), F.linear(x, b.weight, b.bias)], -1))
        assert both.packed.tensor is not None
    x = torch.randn(4, 96, requires_grad=True)
    assert fused.Linear(96, 8).to(torch.bfloat16)(x.to(torch.bfloat16)).requires_grad  # autograd: F.linear

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [7, 64, 256, 1003, 4096, 5120])
def test_rms_norm_is_bit_identical_to_transformers(hidden, dtype):
    """Our RMSNorm in fp32 and bf16 (the C++ kernel where it builds, else ``F.rms_norm`` or the torch lines) and its
    fused residual add equal transformers' LlamaRMSNorm bit for bit, and so does the torch fallback. The C++ kernel
    sums squares in the order of torch's sum kernel: a torch version that sums otherwise fails here."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from pagedattn.kernels import cpu
    from pagedattn.model.llama import RMSNorm

    torch.manual_seed(hidden)
    ours, theirs = RMSNorm(hidden, 1e-6).to(dtype), LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(hidden))
        theirs.weight.copy_(ours.weight)
        x, residual = (torch.randn(37, hidden) * 3).to(dtype), torch.randn(37, hidden).to(dtype)
        assert torch.equal(ours(x), theirs(x))
        normed, h = ours.add_and_norm(x, residual.clone())
        assert torch.equal(h, residual + x) and torch.equal(normed, theirs(residual + x))
        assert cpu.available() or os.environ.get("CI") != "true"
        with patch.object(cpu, "takes", lambda *xs, **kw: False):  # the torch lines
            assert torch.equal(ours(x), theirs(x))
            normed, h = ours.add_and_norm(x, residual)
            assert torch.equal(normed, theirs(residual + x))


def test_cpu_linear_weights_are_stored_transposed():
    """On the CPU, linear weights are [in, out] in memory (a faster GEMM for a decode step's few rows), q/k/v as
    column blocks of one fused weight after the first forward; a tied LM head keeps the embedding's layout."""
    hf = tiny_llama(tie_word_embeddings=True)
    model = load_model(hf)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (64, 64) and q.stride() == (1, 64)
    assert model.model.layers[0].mlp.down_proj.weight.stride() == (1, 64)  # [64, 128] stored [128, 64]
    paged_last_logits(model, PROMPTS[:1])
    assert q.stride() == (1, 64 + 32 + 32)  # q | k | v columns of one [in, out] tensor
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_rope_is_bit_identical_to_transformers(rope, dtype):
    """Our RoPE (one cos/sin per forward, a roll and a sign-folded sin) equals transformers' rotate_half formula bit
    for bit, on q and k at once, in fp32 and bf16, in torch and in place in C++."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from pagedattn.model.llama import RotaryEmbedding, apply_rope

    hf = tiny_llama_rope(ROPES[rope])
    positions = torch.arange(0, 200, 3)
    q, k = torch.randn(len(positions), 4, 16).to(dtype), torch.randn(len(positions), 2, 16).to(dtype)
    cos, sin = LlamaRotaryEmbedding(hf.config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cos_sin = RotaryEmbedding(hf.config, 16)(positions, dtype)
    qk = torch.cat([q, k], 1)
    ours = apply_rope(qk, *cos_sin)
    assert torch.equal(ours[:, :4], want_q[0].transpose(0, 1)) and torch.equal(ours[:, 4:], want_k[0].transpose(0, 1))
    qkv = torch.cat([qk, torch.randn(len(positions), 2, 16).to(dtype)], 1)  # in place on a view of a fused q|k|v (C++)
    assert apply_rope(qkv[:, :6], *cos_sin, in_place=True).data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :6], ours)


@pytest.mark.parametrize("make", [tiny_llama, tiny_opt])
def test_batched_prefill_of_fresh_and_cached_sequences_in_one_step(make, prefill_path):
    """One step prefills a prompt's tail over its cached head beside whole new prompts (the batched path's masked
    case, with contexts and queries of different lengths), and a step of new prompts only (its causal case): every
    last-token logit equals transformers'."""
    hf = make()
    model = load_model(hf)
    bm = block_manager(4, 64)
    per_seq = PerSequence(bm)
    runner = ModelRunner(model, bm.cache_layout(), kernels.get_backend("torch"), torch.device("cpu"), torch.float32)
    cached, fresh = PROMPTS[2], [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    head = Sequence(0, cached[:13])
    per_seq.allocate(0, 13)
    head.status = "running"
    first = SequenceGroup("0", [head], SamplingParams())
    runner.forward(runner.prepare_input(lay_out(SchedulerOutputs(prefill_groups=[first]), bm)))
    head.num_computed_tokens = head.get_len()
    for t in cached[13:]:
        head.append_token(t)
        per_seq.append_slot(0)
    groups = [first]
    for i, p in enumerate(fresh, 1):
        s = Sequence(i, p)
        per_seq.allocate(i, len(p))
        s.status = "running"
        groups.append(SequenceGroup(str(i), [s], SamplingParams()))
    logits, _ = runner.forward(runner.prepare_input(lay_out(SchedulerOutputs(prefill_groups=groups), bm)))
    for row, p in zip(logits, [cached] + fresh):
        torch.testing.assert_close(row, hf_last_logits(hf, p), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["relu", "silu", "swish", "gelu", "gelu_new"])
def test_activations_are_bit_identical_to_transformers(name, dtype):
    """``model.activations.activation`` (torch's own modules, so that a server's start skips
    ``transformers.activations``) computes what transformers' ``ACT2FN`` entry of the same name computes, bit for
    bit, on fresh inputs; a name it does not build itself (``gelu_new``) is transformers' own."""
    from transformers.activations import ACT2FN

    from pagedattn.model.activations import activation

    x = (torch.randn(53, 129, generator=torch.Generator().manual_seed(len(name))) * 4).to(dtype)
    assert torch.equal(activation(name)(x), ACT2FN[name](x))


def test_loading_an_opt_checkpoint_imports_no_dynamo(tmp_path):
    """An OPT checkpoint (what notebook 13's servers load) loads without importing ``torch._dynamo``: the meta
    device's random initialisation and ``transformers.activations`` each imported it, 2 s of a server's 4.5 s start on
    the 2-core VM. (A Llama checkpoint still does: transformers' ``configuration_llama`` imports
    ``transformers.activations`` itself.) The model still gives transformers' logits
    (``test_load_from_checkpoint_folder``)."""
    import subprocess
    import sys

    tiny_opt().save_pretrained(tmp_path)
    code = ("import sys; from pagedattn.model import load_model; load_model(sys.argv[1]); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
