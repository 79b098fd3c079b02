"""fuseforge.patch / unpatch on tiny random Hugging Face Llama, Mistral and Qwen2 models: patched
and unpatched losses, gradients, logits and generations agree; unpatch restores the model."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fuseforge  # noqa: F401,E402  (loads the extension)
# `from fuseforge.patch import ...` reaches the module even where fuseforge/__init__ binds the name
# fuseforge.patch to the function.
from fuseforge.patch import is_patched, patch, stats, unpatch  # noqa: E402
from harness import assert_rel_close, generator, requires_cuda  # noqa: E402

VOCAB = 131  # odd


def tiny_config(family: str, head_dim: int = 16, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=head_dim,
                  attn_implementation="sdpa", **extra)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(family)


def make_model(family: str, dtype=torch.float32, device="cpu", **extra):
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[family]
    torch.manual_seed(0)
    model = cls(tiny_config(family, **extra))
    with torch.no_grad():  # random norms and biases too, so every parameter is exercised
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(device=device, dtype=dtype)


def tokens(batch, seq, device="cpu"):
    return torch.randint(0, VOCAB, (batch, seq), generator=generator("cpu")).to(device)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_loss_and_grads(model, ids, labels):
    """The unpatched model's logits with the causal-LM loss in the model's dtype (transformers' own
    loss casts the logits to float32, which would cap a float64 comparison)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def kernel_calls():
    return stats["fuseforge"], stats["sdpa"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_patched_loss_and_gradients_match_unpatched(family, dtype):
    model = make_model(family, dtype)
    ids = tokens(3, 19)
    labels = ids.clone()
    labels[0, :4] = -100  # ignored positions
    ref_loss, ref_grads = reference_loss_and_grads(model, ids, labels)
    hf = model(input_ids=ids, labels=labels).loss  # transformers' loss (float32 logits)
    assert abs(hf.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()

    patch(model)
    assert is_patched(model) and model.config._attn_implementation == "fuseforge"
    before = kernel_calls()
    out, got_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    after = kernel_calls()
    assert after[0] - before[0] == model.config.num_hidden_layers, "every layer must run fuseforge attention"
    assert after[1] == before[1], "no layer may fall back to SDPA"
    assert out.logits is None, "with labels, the logits must not be materialised"

    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert out.loss.dtype == dtype
    assert abs(out.loss.item() - ref_loss.item()) <= tol * ref_loss.item()
    assert set(got_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name], g, 20 * tol, f"grad {name}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_and_generation_match_unpatched(family):
    model = make_model(family)
    # No pad_token_id (0) in the prompt: generate would infer a padding mask from it, and a real
    # mask goes to SDPA (the inputs are fresh random tokens each session).
    ids = tokens(2, 11).clamp_min(1)
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
        ref_gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    patch(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        before = kernel_calls()
        gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        after = kernel_calls()
    assert_rel_close(logits, ref_logits, 2e-5, "logits")
    assert torch.equal(gen, ref_gen)
    # every prefill and decode step went through the registered function; for Llama (no mask:
    # one query against the cache in the decode steps) through the kernel. Qwen2's generate may
    # materialise a causal mask, which goes to SDPA.
    calls = model.config.num_hidden_layers * 6
    assert (after[0] - before[0]) + (after[1] - before[1]) >= calls
    if family == "llama":
        assert after[0] - before[0] >= calls and after[1] == before[1]


def test_padding_mask_falls_back_to_sdpa_and_matches():
    model = make_model("llama")
    ids = tokens(2, 13)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: a real mask, which the kernel does not take
    labels = ids.masked_fill(mask == 0, -100)
    ref, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    patch(model)
    before = kernel_calls()
    out, got_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    after = kernel_calls()
    assert after[1] - before[1] == model.config.num_hidden_layers and after[0] == before[0]
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-5 * ref.loss.item()
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name], g, 4e-4, f"grad {name}")
    # an all-ones mask is no mask: the kernel runs
    before = kernel_calls()
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert kernel_calls()[0] - before[0] == model.config.num_hidden_layers


def test_num_items_in_batch_shift_labels_and_return_dict():
    model = make_model("llama")
    ids = tokens(2, 9)
    n = torch.tensor(11)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
        shifted = torch.roll(ids, -1, 1)
        ref_shift = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
    patch(model)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
        got_shift = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
        as_tuple = model(input_ids=ids, labels=ids, return_dict=False)
    assert abs(got.item() - ref.item()) <= 2e-5 * ref.item()
    assert abs(got_shift.item() - ref_shift.item()) <= 2e-5 * ref_shift.item()
    assert isinstance(as_tuple, tuple) and torch.is_tensor(as_tuple[0]) and as_tuple[0].dim() == 0


def test_unpatch_restores_the_model():
    model = make_model("mistral")
    state = copy.deepcopy(model.state_dict())
    assert patch(model) is model
    assert patch(model) is model  # twice: no-op
    assert "forward" in vars(model)
    assert unpatch(model) is model
    assert not is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    assert "forward" not in vars(model)
    ids = tokens(2, 7)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and out.logits.shape == (2, 7, VOCAB)
    before = kernel_calls()
    model(input_ids=ids)
    assert kernel_calls() == before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert unpatch(model) is model  # unpatching an unpatched model: no-op


def test_base_model_attention_only():
    model = make_model("qwen2").model  # Qwen2Model: no head, no loss
    ids = tokens(2, 10)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    patch(model)
    assert "forward" not in vars(model)
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
    assert_rel_close(got, ref, 2e-5, "hidden states")
    unpatch(model)
    assert model.config._attn_implementation == "sdpa"


def test_fp32_weights_under_autocast_cpu():
    """Autocast (here the CPU's bf16 autocast, the same code path as CUDA's): q and k leave the rotary
    embedding in fp32 while v is bf16; the kernel still runs, on bf16 inputs."""
    model = make_model("llama")
    ids = tokens(2, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=ids)
        patch(model)
        before = kernel_calls()
        out, got_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert kernel_calls()[0] - before[0] == model.config.num_hidden_layers and kernel_calls()[1] == before[1]
    assert out.logits is None
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-2 * ref.loss.item()
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name], g, 8e-2, f"grad {name}")


def test_bf16_weights_cpu():
    """bf16 weights (the recommended recipe) on the CPU: the kernels take bf16 and compute in fp32."""
    model = make_model("mistral", torch.bfloat16)
    ids = tokens(2, 24)
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    patch(model)
    before = kernel_calls()
    out, got_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert kernel_calls()[0] - before[0] == model.config.num_hidden_layers
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-2 * ref.loss.item()
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name].float(), g.float(), 8e-2, f"grad {name}")


def test_torch_compile_traces_the_kernels_once():
    """Under torch.compile the patched model runs fuseforge attention (transformers builds a full
    causal mask while tracing on torch < 2.14; the patch's mask function must skip it), the loss runs
    linear_cross_entropy, and repeated steps reuse the first graphs (no recompilation on a counter)."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    patch(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    ids = tokens(2, 17)
    for step in range(3):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            n_graphs = len(graphs)
    assert len(graphs) == n_graphs, "the patched model recompiled on a later step"
    code = "\n".join(graphs)
    assert "fuseforge.attention_fwd" in code and "fuseforge.linear_cross_entropy" in code
    assert "scaled_dot_product_attention" not in code
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    torch._dynamo.reset()


def test_unsupported_model_is_refused():
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        patch(torch.nn.Linear(3, 3))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_cuda_matches_unpatched(family):
    """The recommended recipe: bf16 weights; head_dim 64 (a kernel head dim)."""
    model = make_model(family, torch.bfloat16, "cuda", head_dim=64)
    ids = tokens(2, 160, "cuda")
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    patch(model)
    before = kernel_calls()
    out, got_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert kernel_calls()[0] - before[0] == model.config.num_hidden_layers
    assert out.logits is None
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-2 * ref.loss.item()
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name], g, 5e-2, f"grad {name}")


@requires_cuda
@pytest.mark.cuda
def test_fp32_weights_under_autocast_cuda():
    """The eager recipe (fp32 weights, bf16 autocast) patched: the kernel gets bf16 inputs."""
    model = make_model("llama", torch.float32, "cuda", head_dim=128)
    ids = tokens(2, 96, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=ids)
        patch(model)
        before = kernel_calls()
        out, got_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert kernel_calls()[0] - before[0] == model.config.num_hidden_layers
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-2 * ref.loss.item()
    for name, g in ref_grads.items():
        assert_rel_close(got_grads[name], g, 5e-2, f"grad {name}")
