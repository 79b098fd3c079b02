"""fuseforge optimizers: drop-in replacements for torch.optim ones.

AdamW: torch.optim.AdamW's math (decoupled weight decay, bias correction, amsgrad, maximize) with
one kernel launch per step and device for every parameter of every group, whatever their number,
sizes and dtypes (float32, float16, bfloat16; float64 on the CPU). The parameter list lives in a
C++ handle that reads each ``param.grad`` itself, so a step costs no Python loop over parameters;
the tensor table, block map and grad addresses live in device memory and are re-uploaded only when
they change. No host synchronization in ``step()``. ``state_dtype="bfloat16"`` or ``"int8"`` keeps
the two moments in 4 or about 2 bytes a parameter instead of 8, decoded and re-encoded inside the
same kernel. ``paged=True`` keeps the states of CUDA parameters in CUDA managed memory, prefetched to
the GPU at every step, so that under memory pressure they page to host memory instead of failing.

DTensor parameters (FSDP2's ``fully_shard``, tensor parallel): the handle holds each parameter's
local shard and the kernel updates the local shards of every parameter, sharded or not, in the same
one launch per device; nothing is gathered. States are DTensors with the parameter's mesh and
placements (``step`` a plain tensor, as torch.optim.AdamW keeps it), so
``torch.distributed.checkpoint`` saves and loads them, interchangeably with torch.optim.AdamW's.
int8 states' block scales are the exception: they are per local shard, so they form a DTensor
sharded on dim 0 with one padded length a rank (see ``_absmax_len``).
"""
from __future__ import annotations

import weakref
from itertools import chain
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

try:  # torch.distributed can be absent from a build (USE_DISTRIBUTED=0)
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor, Replicate, Shard, distribute_tensor = None, None, None, None

import fuseforge.ops.adamw  # noqa: F401  (fake kernels)

__all__ = ["AdamW"]

_ops = torch.ops.fuseforge
_AMSGRAD, _MASTER, _PAGED = 1, 2, 16
_STATE_FLAGS = {"float32": 0, "bfloat16": 4, "int8": 8}  # csrc/adamw/adamw.h
_ABSMAX_LEN_SHIFT = 32  # param_flags bits that carry a padded absmax length (kAbsmaxLenShift)
_ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")
# The order of adamw_handle_state / adamw_handle_set_state.
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param", "exp_avg_absmax", "exp_avg_sq_absmax")
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_STATE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8",
                 torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}
# Parameters with fewer elements keep float32 states whatever state_dtype says: their states are
# small, and a few 256-element blocks of int8 codes would quantize them coarsely.
MIN_COMPACT_NUMEL = 4096
QUANT_BLOCK = 256  # elements per absmax of int8 states (csrc/adamw/adamw_lowbit.h)


def _as_float(x) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _check_hypers(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
    elif not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas}")
    for i, b in enumerate(betas):
        if not 0.0 <= _as_float(b) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {_as_float(b)} (must be in [0, 1))")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")


def _check_state_dtype(state_dtype, amsgrad) -> str:
    """The state_dtype setting as one of "float32", "bfloat16", "int8" (torch dtypes accepted)."""
    try:
        name = _STATE_DTYPES.get(state_dtype)
    except TypeError:  # unhashable
        name = None
    if name is None:
        raise ValueError(f"AdamW: state_dtype must be 'float32', 'bfloat16' or 'int8', got {state_dtype!r}")
    if name == "int8" and amsgrad:
        raise ValueError("AdamW: amsgrad=True is not supported with state_dtype='int8'; use 'bfloat16' or 'float32'")
    return name


def _check_paged(paged) -> bool:
    if not isinstance(paged, bool):
        raise ValueError(f"AdamW: paged must be True or False, got {paged!r}")
    return paged


def _state_format(group: dict, p: Tensor) -> str:
    """How parameter p of `group` stores its moments: the group's state_dtype, except float32 for
    parameters below MIN_COMPACT_NUMEL elements (float64 parameters keep float64 states)."""
    fmt = group["state_dtype"]
    # A DTensor's global numel decides, so every rank has the same state keys (DCP needs that).
    if fmt == "float32" or p.dtype == torch.float64 or p.numel() < MIN_COMPACT_NUMEL:
        return "float32"
    return fmt


def _blocks(numel: int) -> int:
    return -(-numel // QUANT_BLOCK)


def _absmax_len(p: Tensor) -> int:
    """The length of the int8 absmax arrays of DTensor parameter p on every rank: the block count of
    the largest local shard its placements can give a rank (torch.chunk's split: ceil(size / n) on each
    sharded dim). One length everywhere makes the scales an evenly sharded DTensor of
    ``_absmax_len(p) * shards`` entries, which DCP saves and loads rank by rank (a rank's scales only
    make sense with its own shard of the codes); the entries past a rank's own block count stay 0."""
    sizes = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            n = p.device_mesh.size(mesh_dim)
            sizes[placement.dim] = -(-sizes[placement.dim] // n)
    numel = 1
    for s in sizes:
        numel *= s
    cap = _blocks(numel)
    local = _blocks(p._local_tensor.numel())
    if local > cap:  # pragma: no cover (a placement that splits unlike torch.chunk)
        raise ValueError(f"AdamW: state_dtype='int8' on a DTensor parameter of shape {tuple(p.shape)} with placements "
                         f"{tuple(p.placements)}: its local shard ({local} blocks) exceeds the {cap} blocks expected "
                         "of these placements; use state_dtype='bfloat16' or 'float32'")
    return cap


def _absmax_placements(p: Tensor) -> tuple[tuple, int]:
    """The placements of DTensor parameter p's int8 absmax arrays (sharded on dim 0 over every mesh
    dim that shards p, replicated over the others) and the number of pieces they are split into."""
    placements, shards = [], 1
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            placements.append(Shard(0))
            shards *= p.device_mesh.size(mesh_dim)
        else:
            placements.append(Replicate())
    return tuple(placements), shards


def _wrap_absmax(t: Tensor, p: Tensor) -> Tensor:
    """A local (padded) absmax array of DTensor parameter p as a DTensor (no communication)."""
    placements, shards = _absmax_placements(p)
    return DTensor.from_local(t, p.device_mesh, placements, shape=(t.numel() * shards,), stride=(1,),
                              run_check=False)


def _is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(p: Tensor) -> Tensor:
    """The tensor the kernel updates: a DTensor's local shard (the very tensor FSDP2 keeps, not a
    view of it), a plain tensor itself."""
    return p._local_tensor if _is_dtensor(p) else p


def _wrap_like(t: Tensor, p: Tensor) -> Tensor:
    """A local state tensor as a DTensor laid out like DTensor parameter p (no communication)."""
    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _local_state(p: Tensor, value: Tensor, key: str) -> Tensor:
    """The local tensor the handle adopts for state `value` of parameter p: a DTensor state is
    redistributed to p's mesh and placements if it differs (a state loaded with other placements);
    a plain full-size state of a DTensor parameter is distributed like p. int8 block scales
    (`_ABSMAX_KEYS`) pair with the local shard of the codes they were saved with, so they load only
    from the same sharding; the handle gets the local shard's own blocks (it pads them again)."""
    if key in _ABSMAX_KEYS:
        if _is_dtensor(p) != _is_dtensor(value):
            raise ValueError(f"AdamW: int8 state '{key}' was saved for a {'DTensor' if _is_dtensor(value) else 'plain'} "
                             f"parameter and cannot load into a {'DTensor' if _is_dtensor(p) else 'plain'} one (its "
                             "block scales follow the local shard); convert the checkpoint through a fuseforge AdamW "
                             "with state_dtype='float32' (its state_dict holds float states)")
        if not _is_dtensor(p):
            return value
        want = _absmax_placements(p)[0]
        if value.device_mesh != p.device_mesh or tuple(value.placements) != want:
            raise ValueError(f"AdamW: int8 state '{key}' was saved with mesh {value.device_mesh} and placements "
                             f"{tuple(value.placements)}; this parameter needs {p.device_mesh} and {want} (int8 "
                             "states load only into the sharding they were saved with)")
        return value._local_tensor[:_blocks(_local(p).numel())]
    if _is_dtensor(p):
        if _is_dtensor(value):
            if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
                value = value.redistribute(p.device_mesh, p.placements)
            return value._local_tensor
        if value.shape != p.shape:
            raise ValueError(f"AdamW: state '{key}' of a DTensor parameter of shape {tuple(p.shape)} is a plain "
                             f"tensor of shape {tuple(value.shape)}; expected a DTensor or the full tensor")
        return distribute_tensor(value.to(p.device), p.device_mesh, p.placements)._local_tensor
    if _is_dtensor(value):  # a sharded state for a plain parameter: gather it
        return value.full_tensor()
    return value


_TORCH_GROUP_KEYS: Optional[dict[str, Any]] = None
# Group keys that belong to the optimizer that loads a state dict, not to the one that saved it.
_LOADER_SETTINGS = ("master_weights", "state_dtype", "paged")


def _torch_group_keys() -> dict[str, Any]:
    """The param-group keys torch.optim.AdamW has and this AdamW does not (foreach, fused,
    differentiable, decoupled_weight_decay, ... as this torch version has them), with torch's
    defaults. state_dict() writes them, so that torch.distributed.checkpoint, which loads exactly
    the keys of the target optimizer's state dict, can load a fuseforge checkpoint into
    torch.optim.AdamW."""
    global _TORCH_GROUP_KEYS
    if _TORCH_GROUP_KEYS is None:
        d = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
        _TORCH_GROUP_KEYS = {k: v for k, v in d.items()
                             if k not in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable")}
    return _TORCH_GROUP_KEYS


def _init_state(st: dict, p: Tensor, fmt: str, amsgrad: bool, master_weights: bool) -> None:
    """Fresh (zero) states of parameter p in format `fmt`, as the C++ handle creates them."""
    full = torch.float64 if p.dtype == torch.float64 else torch.float32
    moment = {"float32": full, "bfloat16": torch.bfloat16, "int8": torch.uint8}[fmt]
    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    st["exp_avg"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
    if fmt == "int8":  # code 0 is 0 whatever the absmax
        for key in _ABSMAX_KEYS:
            if _is_dtensor(p):
                st[key] = _wrap_absmax(torch.zeros(_absmax_len(p), dtype=torch.float32, device=p.device), p)
            else:
                st[key] = torch.zeros(_blocks(p.numel()), dtype=torch.float32, device=p.device)
    if amsgrad:
        st["max_exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
    if master_weights and p.dtype in (torch.float16, torch.bfloat16):
        st["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)


class _DeviceHandle:
    """The C++ handle of one device: its parameters (in group order), the groups it serves and the
    float32 step counts (state["step"] of each parameter is a view of one element). `params` are
    the optimizer's parameters, `tensors` what the C++ handle holds (a DTensor's local shard);
    `dtensors` the (parameter, local shard) pairs whose grads step() points the shards at."""

    def __init__(self, device, group_ids, params, tensors, flags, steps, handle):
        self.device = device
        self.group_ids = group_ids
        self.params = params
        self.tensors = tensors
        self.flags = flags
        self.steps = steps
        self.handle = handle
        self.dtensors = [(p, t) for p, t in zip(params, tensors) if p is not t]
        self.finalizer = weakref.finalize(self, _ops.adamw_handle_destroy, handle, steps)

    def point_grads(self) -> bool:
        """Sets each local shard's .grad to its DTensor parameter's grad's local tensor (the handle
        reads .grad in C++). False when FSDP replaced a local shard since the handle was built."""
        for p, t in self.dtensors:
            if p._local_tensor is not t:
                return False
            g = p.grad
            if g is None:
                t.grad = None
                continue
            if not _is_dtensor(g):
                raise RuntimeError("AdamW: a DTensor parameter has a plain-tensor grad; expected a DTensor grad "
                                   f"(parameter of shape {tuple(p.shape)})")
            gs, ps = g._spec, p._spec  # FSDP2 gives the grad the param's spec object: the fast path
            if gs is not ps and (gs.placements != ps.placements or gs.mesh != ps.mesh):
                g = g.redistribute(p.device_mesh, p.placements)
            t.grad = g._local_tensor
        return True

    def release_grads(self) -> None:
        """Drops the local shards' references to the grads (which stay on the DTensor params)."""
        for _, t in self.dtensors:
            t.grad = None


class AdamW(Optimizer):
    r"""AdamW with a multi-tensor-apply fused kernel: one launch per step for all parameters.

    Args:
        params: parameters or parameter groups (every group's parameters on one device).
        lr (float or Tensor): learning rate. A 0-dim CUDA tensor is read by the kernel at run time,
            so schedulers that ``fill_`` it reach CUDA-graph replays; a float change takes effect on
            the next ``step()`` (no recompile, no sync).
        betas, eps, weight_decay, amsgrad, maximize: as in torch.optim.AdamW.
        master_weights (bool): keep a float32 master copy of float16/bfloat16 parameters
            (``state["master_param"]``); the update runs on it and is rounded into the parameter.
        capturable (bool): allow ``step()`` inside CUDA-graph capture. Every step is capture-safe
            (step counts, lr tensors, ``grad_scale`` and ``found_inf`` are read on the device);
            state is created at a parameter's first grad, so run one step before capturing.
        state_dtype (str): how ``exp_avg`` and ``exp_avg_sq`` are stored. ``"float32"`` (the
            default; float64 for float64 CPU params). ``"bfloat16"``: bfloat16, stochastically
            rounded (``max_exp_avg_sq`` too). ``"int8"``: 8-bit codes (uint8 tensors shaped like the
            parameter) and one float32 absmax per 256 elements (``exp_avg_absmax``,
            ``exp_avg_sq_absmax``); no amsgrad. Parameters with fewer than ``MIN_COMPACT_NUMEL``
            (4096) elements, float64 ones, keep full-precision states. A per-group setting; the
            codes are described in docs/design/adamw.md.
        paged (bool): keep the states of CUDA parameters (moments, ``max_exp_avg_sq``, master
            weights, int8 block scales) in CUDA managed memory: one allocation per device, advised
            to live on the parameters' GPU and prefetched there on the current stream at the start
            of every step, so that when GPU memory runs short its pages move to host memory
            instead of an allocation failing. The step stays one launch and does not synchronize.
            Needs concurrent managed access (Linux, Pascal or newer; an error says so otherwise).
            CPU parameters ignore it (their states are in host memory already). A per-group
            setting; a setting of this optimizer, not of its checkpoints.

    Optimizer states are float32 whatever the parameter dtype (float64 for float64 CPU params)
    unless ``state_dtype`` says otherwise. ``state_dict()`` / ``load_state_dict()`` use
    torch.optim.AdamW's format (keys ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``; plus
    ``master_param`` with master weights, and the two absmax keys with int8 states), so float32
    checkpoints move both ways. Loading converts states to this optimizer's ``state_dtype``
    (float states are quantized, int8 ones dequantized), so an int8 checkpoint reaches
    torch.optim.AdamW through a ``state_dtype="float32"`` fuseforge AdamW's ``state_dict()``.
    GradScaler: ``grad_scale``/``found_inf`` are handled in the kernel
    (``_step_supports_amp_scaling``); a step with ``found_inf`` set changes nothing.

    DTensor parameters (FSDP2, tensor parallel) are updated through their local shards in the
    same launch as the others; their states are DTensors laid out like the parameter (``step`` a
    plain tensor), so ``torch.distributed.checkpoint`` and its ``get/set_optimizer_state_dict``
    work, with checkpoints interchangeable with torch.optim.AdamW's. Plain and DTensor parameters
    may be mixed. With ``state_dtype="int8"`` the codes are DTensors like the parameter and each
    rank's block scales a padded piece of a DTensor sharded on dim 0, so DCP checkpoints of int8
    states load back into the same mesh and placements (a new world size fails with DCP's size
    mismatch; convert through ``state_dtype="float32"`` to reshard).

    With ``paged=True``, ``state_dict()`` holds the paged tensors themselves (no copy, as for
    ordinary states); ``load_state_dict()`` copies the loaded values into this optimizer's managed
    memory. Under ``torch.compile`` the traced step updates whatever states exist (paged ones once
    an eager step or a load has made them) without a prefetch; states it creates itself are ordinary
    device memory until the next eager step rebuilds the handles.

    Replacing a state tensor object in ``optimizer.state`` by hand is not seen (in-place edits are);
    use ``load_state_dict``.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False, *,
                 master_weights: bool = False, capturable: bool = False, state_dtype: str = "float32",
                 paged: bool = False):
        _check_hypers(lr, betas, eps, weight_decay)
        state_dtype = _check_state_dtype(state_dtype, amsgrad)
        _check_paged(paged)
        self._handles: Optional[list[_DeviceHandle]] = None
        self._state_count = 0  # len(self.state) as the handles know it
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, master_weights=master_weights, capturable=capturable,
                        state_dtype=state_dtype, paged=paged)
        super().__init__(params, defaults)

    # ---- groups and state ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        devices = {p.device for p in params if isinstance(p, Tensor)}
        if len(devices) > 1:
            raise ValueError("AdamW: all parameters of a param group must be on one device, got "
                             f"{sorted(str(d) for d in devices)}; put each device's parameters in its own group")
        for i, p in enumerate(params):
            if isinstance(p, Tensor):
                if p.is_complex():
                    raise ValueError(f"AdamW: parameter {i} of the group is complex ({p.dtype}); "
                                     "view complex parameters as real (torch.view_as_real)")
                if p.dtype not in _SUPPORTED or (p.dtype == torch.float64 and p.device.type != "cpu"):
                    raise ValueError(f"AdamW: parameter {i} of the group has dtype {p.dtype} on {p.device}; "
                                     "expected float32, float16 or bfloat16 (float64 on the CPU)")
                if p.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"AdamW: parameter {i} is on {p.device}; expected the CPU or a CUDA device")
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in param_group:
                _check_hypers(param_group.get("lr", 0.0), param_group.get("betas", (0.0, 0.0)),
                              param_group.get("eps", 0.0), param_group.get("weight_decay", 0.0))
                break
        param_group["state_dtype"] = _check_state_dtype(
            param_group.get("state_dtype", self.defaults["state_dtype"]),
            param_group.get("amsgrad", self.defaults["amsgrad"]))
        param_group["paged"] = _check_paged(param_group.get("paged", self.defaults["paged"]))
        super().add_param_group(param_group)
        self._invalidate()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("master_weights", False)
            group.setdefault("capturable", False)
            group.setdefault("state_dtype", "float32")
            group.setdefault("paged", False)
        self._invalidate()

    def __getstate__(self) -> dict[str, Any]:
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups}

    def _invalidate(self) -> None:
        handles = getattr(self, "_handles", None)
        if handles:
            for h in handles:
                h.finalizer()
        self._handles = None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format. Each group also carries torch.optim.AdamW's own keys (foreach,
        fused, ... at torch's defaults) and leaves out ``master_weights`` and ``state_dtype``,
        settings of the optimizer that loads the state dict: torch.distributed.checkpoint loads
        exactly the keys of the target's state dict, so this is what lets a checkpoint move both
        ways (the states themselves say how they are stored)."""
        sd = super().state_dict()
        extra = _torch_group_keys()
        sd["param_groups"] = [{**{k: v for k, v in g.items() if k not in _LOADER_SETTINGS},
                               **{k: v for k, v in extra.items() if k not in g}} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The base class casts every floating state to the parameter's dtype; keep the saved
        # precision instead (float32 moments of bfloat16 params stay float32); the handles then
        # convert them to this optimizer's state_dtype.
        saved_state = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        # Settings the saved groups lack (master_weights; anything a torch.optim.AdamW state dict
        # lacks) keep this optimizer's values, and so do state_dtype and paged, even where a group has them.
        kept = [{k: v for k, v in g.items() if k != "params" and (k not in saved or k in ("state_dtype", "paged"))}
                for g, saved in zip(self.param_groups, state_dict["param_groups"])]
        super().load_state_dict(state_dict)
        for g, k in zip(self.param_groups, kept):
            g.update(k)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for sid, p in zip(saved_ids, params):
            saved = saved_state.get(sid)
            if not saved:
                continue
            st = self.state[p]
            for key in _STATE_KEYS:
                v = saved.get(key)
                if isinstance(v, Tensor):
                    st[key] = v.to(device=p.device)
        # The handles adopt the states now, converting them to each parameter's state_dtype, so
        # self.state holds that format (and a malformed state fails here, not at the next step);
        # parameters not yet materialized (meta) wait for the first step.
        self._invalidate()
        if all(_local(p).device.type in ("cpu", "cuda") for p in params):
            self._build_handles()

    def _build_handles(self) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for gi, group in enumerate(self.param_groups):
            if group["params"]:
                by_device.setdefault(group["params"][0].device, []).append(gi)
        handles = []
        for device, group_ids in by_device.items():
            params, groups, flags = [], [], []
            for local, gi in enumerate(group_ids):
                group = self.param_groups[gi]
                f = (_AMSGRAD if group["amsgrad"] else 0) | (_MASTER if group["master_weights"] else 0)
                for p in group["params"]:
                    params.append(p)
                    groups.append(local)
                    fmt = _state_format(group, p)
                    flag = f | _STATE_FLAGS[fmt]
                    if group["paged"] and _local(p).device.type == "cuda":  # CPU states stay as they are
                        flag |= _PAGED
                    if fmt == "int8" and _is_dtensor(p):
                        flag |= _absmax_len(p) << _ABSMAX_LEN_SHIFT
                    flags.append(flag)
            tensors = [_local(p) for p in params]
            steps = torch.zeros(len(params), dtype=torch.float32, device=device)
            handle = _ops.adamw_handle_create(tensors, groups, flags, steps, len(group_ids))
            h = _DeviceHandle(device, group_ids, params, tensors, flags, steps, handle)
            # Adopt existing state (loaded, or created before a rebuild).
            slots, values = [], []
            for slot, p in enumerate(params):
                st = self.state.get(p)
                if not st:
                    continue
                absent = torch.empty(0, dtype=torch.bool)  # the ops' marker for a missing state
                given = [_local_state(p, st[k], k) if isinstance(st.get(k), Tensor) else absent
                         for k in _STATE_KEYS]
                kept = _ops.adamw_handle_set_state(handle, steps, slot, given)
                self._store_state(st, h, slot, kept)
                slots.append(slot)
                values.append(torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).reshape(()).to(device))
            if slots:
                steps[torch.tensor(slots, device=device)] = torch.stack(values)
            for slot in slots:
                self.state[params[slot]]["step"] = steps[slot]
            handles.append(h)
        self._handles = handles
        self._state_count = len(self.state)

    @staticmethod
    def _store_state(st: dict, h: _DeviceHandle, slot: int, kept: list[Tensor]) -> None:
        p = h.params[slot]
        wrap = (lambda t: _wrap_like(t, p)) if p is not h.tensors[slot] else (lambda t: t)
        st["exp_avg"], st["exp_avg_sq"] = wrap(kept[0]), wrap(kept[1])
        if h.flags[slot] & _AMSGRAD:
            st["max_exp_avg_sq"] = wrap(kept[2])
        else:
            st.pop("max_exp_avg_sq", None)
        if h.flags[slot] & _MASTER and p.dtype in (torch.float16, torch.bfloat16):
            st["master_param"] = wrap(kept[3])
        else:
            st.pop("master_param", None)
        for i, key in zip((4, 5), _ABSMAX_KEYS):  # int8 states: a DTensor's are padded per rank
            if kept[i].dtype == torch.float32:
                st[key] = _wrap_absmax(kept[i], p) if p is not h.tensors[slot] else kept[i]
            else:
                st.pop(key, None)

    def _adopt_new_states(self, h: _DeviceHandle) -> None:
        for slot in _ops.adamw_handle_new_slots(h.handle, h.steps):
            st = self.state[h.params[slot]]
            st["step"] = h.steps[slot]
            self._store_state(st, h, slot, _ops.adamw_handle_state(h.handle, h.steps, slot))
        self._state_count = len(self.state)

    # ---- step ---------------------------------------------------------------------------------
    def _capture_check(self) -> None:
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            if not all(g["capturable"] for g in self.param_groups):
                raise RuntimeError("AdamW: step() is being captured in a CUDA graph but capturable=False; "
                                   "construct the optimizer with capturable=True")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            self._step_lists()
            return loss
        self._capture_check()
        if self._handles is None or len(self.state) != self._state_count:
            # New entries in self.state that the handles did not create (a compiled step's): adopt them.
            self._invalidate()
            self._build_handles()
        if not all(h.point_grads() for h in self._handles if h.dtensors):
            # FSDP replaced a DTensor's local shard (its lazy init, module.to_empty(), ...): rebuild.
            self._invalidate()
            self._build_handles()
            for h in self._handles:
                if h.dtensors and not h.point_grads():  # pragma: no cover (a shard replaced while rebuilding)
                    raise RuntimeError("AdamW: a DTensor parameter's local tensor keeps changing")
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        groups = self.param_groups
        for h in self._handles:
            hypers: list[float] = []
            lr_tensors: list[Optional[Tensor]] = []
            any_tensor_lr = False
            for gi in h.group_ids:
                g = groups[gi]
                lr = g["lr"]
                beta1, beta2 = g["betas"]
                if isinstance(lr, Tensor):
                    any_tensor_lr = True
                    lr_tensors.append(lr)
                    lr = 0.0
                else:
                    lr_tensors.append(None)
                hypers += (lr, _as_float(beta1), _as_float(beta2), g["eps"], g["weight_decay"],
                           1.0 if g["maximize"] else 0.0)
            gs = grad_scale if grad_scale is None or grad_scale.device == h.device else \
                grad_scale.to(h.device, non_blocking=True)
            fi = found_inf if found_inf is None or found_inf.device == h.device else \
                found_inf.to(h.device, non_blocking=True)
            try:
                created = _ops.adamw_handle_step(h.handle, h.steps, hypers, lr_tensors if any_tensor_lr else [],
                                                 gs, fi)
            finally:
                if h.dtensors:
                    h.release_grads()
            if created:
                self._adopt_new_states(h)
        return loss

    def _step_lists(self) -> None:
        """The traceable step (torch.compile): one adamw_fused_ call per group over tensor lists."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, maxs, masters, steps = [], [], [], [], [], [], []
            m_absmaxs, v_absmaxs = [], []
            unread = None  # the absmax entry of a tensor without int8 states (the op does not read it)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                fmt = _state_format(group, p)
                if len(st) == 0:
                    _init_state(st, p, fmt, group["amsgrad"], group["master_weights"])
                # DTensor parameters: the op runs on the local shards (states are laid out like p).
                loc = (lambda t: t.to_local()) if _is_dtensor(p) else (lambda t: t)
                params.append(loc(p))
                grads.append(loc(p.grad))
                exp_avgs.append(loc(st["exp_avg"]))
                exp_avg_sqs.append(loc(st["exp_avg_sq"]))
                if group["amsgrad"]:
                    maxs.append(loc(st["max_exp_avg_sq"]))
                if group["master_weights"]:
                    masters.append(loc(st.get("master_param", st["exp_avg"])))
                if "exp_avg_absmax" in st:
                    m_absmaxs.append(loc(st["exp_avg_absmax"]))
                    v_absmaxs.append(loc(st["exp_avg_sq_absmax"]))
                else:
                    unread = torch.empty(0, device=p.device) if unread is None else unread
                    m_absmaxs.append(unread)
                    v_absmaxs.append(unread)
                steps.append(st["step"])
            if not params:
                continue
            if not any(e.dtype == torch.uint8 for e in exp_avgs):
                m_absmaxs, v_absmaxs = [], []
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            _ops.adamw_fused_(params, grads, exp_avgs, exp_avg_sqs, maxs, masters, steps, m_absmaxs, v_absmaxs,
                              lr=0.0 if isinstance(lr, Tensor) else lr, beta1=beta1, beta2=beta2,
                              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                              lr_tensor=lr if isinstance(lr, Tensor) else None, grad_scale=grad_scale,
                              found_inf=found_inf)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets every parameter's grad in one C++ pass (set_to_none, the default) or one
        multi-tensor zero_ (set_to_none=False)."""
        if self._handles is None or len(self.state) != self._state_count or any(h.dtensors for h in self._handles):
            # (DTensor grads live on the DTensor parameters, which the handle does not hold.)
            return super().zero_grad(set_to_none)
        for h in self._handles:
            _ops.adamw_handle_zero_grad(h.handle, h.steps, set_to_none)
