"""The package around the ops: its version, the check that the extension matches the running torch, and
setup.py's build decisions."""
import importlib.util
import os
import re
import types
import warnings

import pytest
import torch

import fuseforge
from fuseforge import _library


def test_version_is_set():
    assert re.fullmatch(r"\d+\.\d+\.\d+", fuseforge.__version__)


def test_extension_built_for_another_torch_names_both_and_how_to_rebuild(monkeypatch):
    fake = types.ModuleType("fuseforge._build_info")
    fake.TORCH_VERSION = "2.99.0+cu999"
    monkeypatch.setitem(__import__("sys").modules, "fuseforge._build_info", fake)
    monkeypatch.delenv("FUSEFORGE_EXTENSION", raising=False)
    with pytest.raises(ImportError, match=r"built against torch 2\.99\.0\+cu999, but torch .* is running") as e:
        _library.load()
    assert torch.__version__ in str(e.value) and "Rebuild" in str(e.value)


def test_missing_extension_says_how_to_build_it(monkeypatch):
    monkeypatch.delenv("FUSEFORGE_EXTENSION", raising=False)
    monkeypatch.delattr(fuseforge, "_C", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "fuseforge._C", None)  # as if never built
    with pytest.raises(ImportError, match=r"fuseforge\._C\) is not built: run `make build`"):
        _library.load()


def test_matching_or_unrecorded_build_loads():
    _library.check_build(torch.__version__)
    _library.check_build(None)


# setup.py's build decisions, as pure functions (in a source tree only: an installed wheel has no setup.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def setup_py():
    path = os.path.join(ROOT, "setup.py")
    if not os.path.exists(path):
        pytest.skip("no setup.py: the tests run against an installed package")
    saved = dict(os.environ)  # setup.py sets CUDA_HOME when it finds /usr/local/cuda
    try:
        spec = importlib.util.spec_from_file_location("fuseforge_setup", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def test_build_without_a_visible_gpu_is_cpu_only_and_says_how_to_build_cuda(setup_py):
    with_cuda, reason = setup_py.decide_cuda({}, gpu_visible=False, have_nvcc=True, torch_cuda=True)
    assert not with_cuda and "no GPU visible" in reason and "FUSEFORGE_CUDA=1" in reason


def test_build_with_a_visible_gpu_nvcc_and_cuda_torch_is_cuda(setup_py):
    assert setup_py.decide_cuda({}, gpu_visible=True, have_nvcc=True, torch_cuda=True)[0]
    # ... and CPU-only where it cannot be: no nvcc, or a CPU torch
    assert not setup_py.decide_cuda({}, gpu_visible=True, have_nvcc=False, torch_cuda=True)[0]
    assert not setup_py.decide_cuda({}, gpu_visible=True, have_nvcc=True, torch_cuda=False)[0]


def test_build_switches_force_either_way(setup_py):
    decide = setup_py.decide_cuda
    assert decide({"FUSEFORGE_CUDA": "1"}, gpu_visible=False, have_nvcc=True, torch_cuda=True) == (True, "FUSEFORGE_CUDA=1")
    assert not decide({"FUSEFORGE_CPU_ONLY": "1"}, gpu_visible=True, have_nvcc=True, torch_cuda=True)[0]
    assert not decide({"FUSEFORGE_CUDA": "0"}, gpu_visible=True, have_nvcc=True, torch_cuda=True)[0]
    with pytest.raises(SystemExit, match="no nvcc"):
        decide({"FUSEFORGE_CUDA": "1"}, gpu_visible=True, have_nvcc=False, torch_cuda=True)
    with pytest.raises(SystemExit, match="CPU-only build"):
        decide({"FUSEFORGE_CUDA": "1"}, gpu_visible=False, have_nvcc=True, torch_cuda=False)
    with pytest.raises(SystemExit, match="contradict"):
        decide({"FUSEFORGE_CUDA": "1", "FUSEFORGE_CPU_ONLY": "1"}, gpu_visible=False, have_nvcc=True, torch_cuda=True)
    with pytest.raises(SystemExit, match="FUSEFORGE_CUDA='yes'"):
        decide({"FUSEFORGE_CUDA": "yes"}, gpu_visible=False, have_nvcc=True, torch_cuda=True)


def test_default_cuda_targets_are_the_visible_gpus_else_the_portable_list(setup_py):
    assert setup_py.default_arch_list([(9, 0)]) == "9.0a"  # the H100/H200: the sm_90a kernels
    assert setup_py.sm90a_only_sm90_target("9.0a")
    assert setup_py.default_arch_list([(8, 0), (9, 0)]) == "8.0;9.0a"
    assert setup_py.default_arch_list([None]) == setup_py.PORTABLE_ARCH_LIST  # nvidia-smi -L only
    portable = setup_py.default_arch_list([])
    assert portable == setup_py.PORTABLE_ARCH_LIST
    archs = portable.split(";")
    assert "9.0a" in archs and any(a.endswith("+PTX") for a in archs)
    assert setup_py.sm90a_only_sm90_target(portable)  # no plain 9.0: the sm_90a-only kernels are built
    assert not setup_py.sm90a_only_sm90_target("8.0;9.0;9.0a")


def _cpu_loss(seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(70, 16, generator=g), torch.randn(50, 16, generator=g)
    target = torch.randint(0, 50, (70,), generator=g)
    return fuseforge.linear_cross_entropy(x, w, target, reduction="none")


def test_development_knobs_are_read_only_in_a_developer_build(monkeypatch):
    """A development knob (here the CPU loss's row chunk) is parsed in a developer build, where a bad
    value raises an error naming it, and never read in any other build: the same bad value changes
    nothing there."""
    from harness import DEV_KNOBS
    expected = _cpu_loss(7)
    monkeypatch.setenv("FUSEFORGE_LCE_CPU_CHUNK_ROWS", "0")
    if DEV_KNOBS:
        with pytest.raises(RuntimeError, match="FUSEFORGE_LCE_CPU_CHUNK_ROWS: expected a positive integer"):
            _cpu_loss(7)
    else:
        assert torch.equal(_cpu_loss(7), expected)


BACKWARD_OPS = ("add_mul_act_bwd", "attention_bwd", "attention_varlen_bwd", "glu_bwd", "layer_norm_bwd",
                "linear_cross_entropy_bwd", "linear_jsd_bwd", "rms_norm_bwd")


def test_every_backward_op_has_an_autograd_kernel():
    """No op is left to torch's deprecated fallback for ops without an autograd kernel (a node that
    warns when reached and passes no gradient on): the backward ops register one that runs below
    autograd."""
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("fuseforge::") and n.endswith("_bwd")}
    assert names == set(BACKWARD_OPS)
    for name in BACKWARD_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fuseforge::{name}", "Autograd"), name


def test_backward_op_outputs_do_not_require_grad():
    """A backward op called on inputs that require grad gives outputs that do not (no warning), and a
    gradient through them fails with autograd's own error rather than reading as zero."""
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    out, h, rstd = torch.ops.fuseforge.rms_norm_fwd(x, weight, None, 1e-6, 0.0, None)
    assert rstd.requires_grad  # through rms_norm_fwd's autograd
    grad_out = torch.randn_like(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grad_x, grad_w = torch.ops.fuseforge.rms_norm_bwd(grad_out, None, x, weight, rstd, 0.0, True)
    assert not grad_x.requires_grad and not grad_w.requires_grad
    # The same values as without grad.
    ref_x, ref_w = torch.ops.fuseforge.rms_norm_bwd(grad_out, None, x.detach(), weight.detach(), rstd.detach(), 0.0,
                                                    True)
    assert torch.equal(grad_x, ref_x) and torch.equal(grad_w, ref_w)
    with pytest.raises(RuntimeError, match="does not require grad"):
        grad_x.sum().backward()
