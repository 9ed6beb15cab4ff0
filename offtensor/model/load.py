"""offtensor.load: wrap a model built on the meta device, filling its host masters scope by scope
from a safetensors checkpoint and/or an init function.

# Note [loading scope by scope]
A model whose full-precision weights do not fit in host RAM (a 70B model in bf16 is 140 GB) can
still be offloaded compressed (Policy(frozen_format="fp8"): 70 GB), but only if it never exists
in full precision on the host. So the model is built on the meta device (`with
torch.device("meta"):` or accelerate's `init_empty_weights()`: shapes, no data), and `load`
builds the scopes one after the other as `wrap` does, except that each master's values come from
the source, one tensor at a time: a checkpoint tensor is copied or quantized into the scope's
host buffer (Note [loading at the disk's speed]), and dropped; quantization works in row blocks
of bounded size. Host memory beyond the masters is then one tensor of the checkpoint plus small temporaries,
whatever the model's size. An init function instead fills one scope's parameters at a time
(allocated uninitialized on the CPU, or on `init_device`), so the extra is one scope in full
precision. Random weights for a benchmark of a 70B shape are 70 billion values, drawn much faster
on the GPU than on the CPU, and compressing them there too means only the 1-byte values and the
scales cross to the host (PackedMaster.pack quantizes on the value's device).

The parts of the model that no scope offloads (embeddings, final norm, head, buffers still on
the meta device) are then loaded the same way onto `rest_device`: directly on the compute
device by default, without a host copy. Persistent buffers that are real (accelerate's
`init_empty_weights` keeps buffers real: a batch norm's running statistics hold their defaults)
are overwritten from the checkpoint, wherever they are, as `load_state_dict` does; non-persistent
ones (rotary tables, computed by the constructor) keep their values. One the checkpoint lacks
would keep its constructor value unseen (batch-norm statistics at their defaults), so all are
looked up, under the prefix the parameters' keys drop, before any is written, and those missing
raise a KeyError naming them (`strict=False`: a warning), as load_state_dict's missing keys do.

# Note [loading at the disk's speed]
A master of the checkpoint's dtype is copied into its place in the scope's host buffer straight
from a mapping of the tensor's bytes in the file, unmapped after the copy: no intermediate
tensor, each byte of the buffer written once (numpy allocates it without zeroing, in huge pages;
the kernel's zeroing of fresh pages is what any owner of the memory pays). A sequential copy out
of a mapping lets the kernel read ahead, so a cold load runs near the disk's speed: preads of
8 MiB pieces on 4 threads took 2-3x longer cold on 2 cores, and safetensors' `get_slice`, which
mapped the file again for every block of rows, loaded at 0.1 GiB/s. Tensors under 1 MiB are one
pread; a master of another dtype (a cast, compression) reads blocks of rows with preads and
converts each as `Tensor.to` does; dtypes torch lacks go through safetensors. Host memory beyond
the masters stays one tensor's mapping. `python -m benchmarks load-speed` times it against
safetensors' own load and against allocating and writing the same bytes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import Policy
from ..engine.engine import ENGINE_ATTR, find_engine
from ..formats import RowReader
from ..storage.checkpoint import Checkpoint
from ..storage.compress import copy_rows
from ..storage.files import FileStore
from .wrapping import Predicate, unwrap, wrap_filling

InitFn = Callable[[str, nn.Module], None]


def load(model: nn.Module, weights: str | os.PathLike | None = None, predicate: Predicate | None = None, *,
         init: InitFn | None = None, device: torch.device | str | None = None, policy: Policy | None = None,
         rest_device: torch.device | str | None = None,
         init_device: torch.device | str | None = None, strict: bool = True,
         cache_dir: str | os.PathLike | None = None) -> nn.Module:
    """`offtensor.wrap` a model built on the meta device, reading its weights scope by scope.

    The model's parameters (all or some) are on the meta device (built under
    `torch.device("meta")` or `accelerate.init_empty_weights()`). Each scope's host buffer is
    filled from the source one tensor at a time, compressed on the fly under
    `Policy(frozen_format=...)`, so peak host memory stays close to the offloaded bytes (the
    masters, one checkpoint tensor and small temporaries); the other meta parameters and
    buffers then go to `rest_device`, and parameters not on the meta device keep their values. A transformers model's
    `tie_weights()` is called first. With `Policy(host_budget=B)` the frozen scopes that do not
    fit B bytes of host RAM stay in the files, read ahead of use into a small staging ring; reads
    through such a parameter read the file, writes to it raise.

    Args:
        model: the model, modified in place; its meta parameters become real (offloaded ones
            keep their identity; the others are new `nn.Parameter`s, tied ones stay tied).
        weights: a Hugging Face checkpoint: a directory with `model.safetensors.index.json`
            (sharded) or `model.safetensors`, or one `.safetensors` file. Keys are the model's
            parameter names; a name that is not found is also tried without PEFT's `.base_layer`
            and without leading components (`base_model.model.`), the same ones for every key.
            Persistent buffers are read from
            it too. Tensors it holds that nothing was read from are named in a warning.
        predicate: as for `wrap`.
        init: `init(module_name, module)` initializes, in place, the parameters the checkpoint
            lacks (all without `weights`), once per module directly holding such parameters,
            after they were allocated uninitialized (on the CPU for a scope, on `rest_device`
            for the rest), e.g. `lambda name, m: model._init_weights(m)` for a transformers
            model. Meta buffers the checkpoint lacks are allocated too; `init` must fill them.
        device: the compute device, as for `wrap`.
        policy: as for `wrap`.
        rest_device: where the parameters and buffers outside the scopes go. Default: `device`.
        init_device: where a scope's parameters are allocated for `init` (default: the CPU).
            The compute device makes a random init fast; the values then go to the host masters
            (compressed on that device under `frozen_format`), one scope at a time.
        strict: a persistent buffer not on the meta device (`init_empty_weights` keeps buffers
            real) must be in the checkpoint: `KeyError` naming those it lacks, as
            `load_state_dict` reports missing keys. False: a warning, and they keep their values.
        cache_dir: under `Policy(host_budget=...)`, where masters that stay on disk but not as
            the checkpoint holds them (compressed, converted, filled by `init`) are written once,
            to a cache file deleted with the process. Default: the checkpoint's directory.

    Returns:
        `model`, wrapped.

    Example::

        config = AutoConfig.from_pretrained(path)
        with accelerate.init_empty_weights():  # buffers stay real (rotary inv_freq is in no checkpoint)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        offtensor.load(model, path, policy=offtensor.Policy(frozen_format="fp8"))
        out = model(input_ids.cuda())
        # larger than host RAM: 32 GiB of it in RAM, the rest read from the files as needed
        offtensor.load(model, path, policy=offtensor.Policy(host_budget="32GiB"))
    """
    _check_sources(weights, init)
    checkpoint = Checkpoint(weights) if weights is not None else None
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # transformers ties on load; a model built empty is not tied yet
        tie()
    init_on = torch.device(init_device) if init_device is not None else torch.device("cpu")
    source = _ScopeFiller(checkpoint, init, _owners(model), init_on, _file_store(policy, weights, cache_dir))
    meta = _MetaTensors(model)
    try:
        wrap_filling(model, predicate, device, policy, source)  # undoes itself should it raise
        engine = find_engine(model)
        assert engine is not None
        rest = torch.device(rest_device) if rest_device is not None else engine.device
        _load_rest(model, checkpoint, init, rest, strict)
    except BaseException:  # Note [a wrap that raised] in wrapping.py: as before the call, for a retry
        if getattr(model, ENGINE_ATTR, None) is not None:
            unwrap(model)
        meta.put_back()
        raise
    if checkpoint is not None:
        checkpoint.warn_unused()
    return model


def _check_sources(weights: str | os.PathLike | None, init: InitFn | None) -> None:
    if weights is None and init is None:
        raise ValueError("offtensor.load: pass weights= (a safetensors checkpoint) or init= (an init function), "
                         "or both")
    if init is not None and not callable(init):
        raise TypeError(f"offtensor.load: init must be callable as init(module_name, module), got "
                        f"{type(init).__name__}")


def _file_store(policy: Policy | None, weights: str | os.PathLike | None,
                cache_dir: str | os.PathLike | None) -> FileStore | None:
    """Under Policy(host_budget), the files masters stay in (Note [masters in files] in
    storage/file_masters.py); the cache file goes beside the checkpoint unless `cache_dir`."""
    if policy is None or policy.host_budget is None:
        return None
    if cache_dir is None and weights is not None:
        cache_dir = Path(weights) if Path(weights).is_dir() else Path(weights).parent
    return FileStore(cache_dir)


class _MetaTensors:
    """The parameters and buffers of a model on the meta device, to put back after a failed load."""

    def __init__(self, model: nn.Module) -> None:
        # (the module's _parameters or _buffers, the name there, the meta tensor)
        self.entries: list[tuple[dict[str, Any], str, torch.Tensor]] = [
            (tensors, name, t)
            for module in model.modules()
            for tensors in (module._parameters, module._buffers)
            for name, t in tensors.items() if t is not None and t.is_meta]

    def put_back(self) -> None:
        for tensors, name, t in self.entries:
            if not t.is_meta:  # offloaded and restored, or allocated for init: the same object
                empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
                torch.utils.swap_tensors(t, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter)
                                         else empty)
            tensors[name] = t  # the rest loaded is a new tensor

def _owners(model: nn.Module) -> dict[int, tuple[list[str], str, nn.Module]]:
    """id(parameter) -> (its qualified names, the name of a module holding it, that module)."""
    owners: dict[int, tuple[list[str], str, nn.Module]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None:
                continue
            qual = f"{mname}.{pname}" if mname else pname
            if id(p) in owners:
                owners[id(p)][0].append(qual)
            else:
                owners[id(p)] = ([qual], mname, module)
    return owners


class _ScopeFiller:
    """The values of one scope's masters at a time (wrap_filling's ScopeSource)."""

    label = "loading weights into host memory"

    def __init__(self, checkpoint: Checkpoint | None, init: InitFn | None,
                 owners: dict[int, tuple[list[str], str, nn.Module]], init_device: torch.device,
                 store: FileStore | None) -> None:
        self.checkpoint = checkpoint
        self.init = init
        self.owners = owners
        self.init_device = init_device
        self.store = store  # Policy(host_budget): checkpoint tensors are FileTensors

    def begin(self, name: str, params: list[tuple[str, nn.Parameter]]) -> None:
        """Allocate (on init_device) and initialize the scope's meta parameters the checkpoint lacks."""
        missing = [(qual, p) for qual, p in params if p.is_meta and self._key(qual, p) is None]
        if not missing:
            return
        if self.init is None:
            qual = missing[0][0]
            raise KeyError(
                f"offtensor.load: the checkpoint has no tensor for parameter {qual!r} (nor "
                f"{len(missing) - 1} other parameters of scope {name!r}); pass init= to initialize "
                "the parameters a checkpoint lacks, or check the checkpoint's keys")
        modules: dict[int, tuple[str, nn.Module]] = {}
        for _, p in missing:
            _, mname, module = self.owners[id(p)]
            torch.utils.swap_tensors(
                p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.init_device), p.requires_grad))
            modules[id(module)] = (mname, module)
        for mname, module in modules.values():
            self.init(mname, module)

    def value(self, qual: str, p: nn.Parameter) -> torch.Tensor | RowReader:
        if not p.is_meta:
            return p.detach()  # kept, or allocated and initialized by `begin`
        key = self._key(qual, p)
        assert key is not None and self.checkpoint is not None  # else begin allocated it
        if self.store is not None:  # read in place if its scope stays in the file
            return self.checkpoint.in_file(key, qual, p, self.store)
        return self.checkpoint.rows(key, qual, p)

    def end(self) -> None:
        pass

    def _key(self, qual: str, p: nn.Parameter) -> str | None:
        if self.checkpoint is None:
            return None
        names = self.owners[id(p)][0] if id(p) in self.owners else [qual]
        return self.checkpoint.find([qual, *names])


def _load_rest(model: nn.Module, checkpoint: Checkpoint | None, init: InitFn | None, device: torch.device,
               strict: bool) -> None:
    """The parameters and buffers no scope offloaded, still on the meta device, onto `device`;
    the real persistent buffers, in the scopes too, from the checkpoint."""
    real_keys = _real_buffer_keys(model, checkpoint, strict) if checkpoint is not None else {}
    done: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its replacement (tied weights)
    owners = _owners(model)
    to_init: dict[int, tuple[str, nn.Module]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                qual = f"{mname}.{pname}" if mname else pname
                key = checkpoint.find(owners[id(p)][0]) if checkpoint is not None else None
                if key is not None:
                    assert checkpoint is not None
                    value = torch.empty(p.shape, dtype=p.dtype, device=device)
                    copy_rows(value, checkpoint.rows(key, qual, p))
                elif init is not None:
                    value = torch.empty(p.shape, dtype=p.dtype, device=device)
                    to_init[id(module)] = (mname, module)
                else:
                    raise KeyError(
                        f"offtensor.load: the checkpoint has no tensor for parameter {qual!r}; "
                        "pass init= to initialize the parameters a checkpoint lacks")
                done[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            module._parameters[pname] = done[id(p)]
        for bname, b in list(module._buffers.items()):
            real = b is not None and not b.is_meta
            if b is None or (real and (checkpoint is None or bname in module._non_persistent_buffers_set)):
                continue  # nothing to fill: a real buffer the checkpoint has no say on
            qual = f"{mname}.{bname}" if mname else bname
            if real:  # a real persistent buffer: the checkpoint's values (Note [loading scope by scope])
                key = real_keys.get(qual)
                if key is not None:
                    assert checkpoint is not None
                    with torch.no_grad():
                        b.copy_(checkpoint.rows(key, qual, b).read())
                continue
            key = checkpoint.find([qual]) if checkpoint is not None else None
            if key is not None:
                assert checkpoint is not None
                module._buffers[bname] = checkpoint.rows(key, qual, b).read().to(device)
            elif init is not None:
                module._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
                to_init[id(module)] = (mname, module)
            else:
                raise KeyError(
                    f"offtensor.load: buffer {qual!r} is on the meta device and not in the "
                    "checkpoint (a non-persistent buffer, such as rotary embeddings' inv_freq); "
                    "build the model under accelerate.init_empty_weights(), which keeps buffers "
                    "real, or pass init= to fill it")
    for mname, module in to_init.values():
        assert init is not None
        init(mname, module)


def _real_buffer_keys(model: nn.Module, checkpoint: Checkpoint, strict: bool) -> dict[str, str | None]:
    """The checkpoint key of each real persistent buffer, by qualified name, found before any of
    them is written: those the checkpoint lacks raise a KeyError naming them, or with
    `strict=False` are named in a warning and keep their values (Note [loading scope by scope])."""
    keys: dict[str, str | None] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for bname, b in module._buffers.items():
            if b is not None and not b.is_meta and bname not in module._non_persistent_buffers_set:
                qual = f"{mname}.{bname}" if mname else bname
                keys[qual] = checkpoint.find([qual], other_prefixes=False)
    missing = [qual for qual, key in keys.items() if key is None]
    if missing:
        names = ", ".join(repr(q) for q in missing[:5]) + (", ..." if len(missing) > 5 else "")
        what = (f"offtensor.load: the checkpoint has no tensor for {len(missing)} persistent "
                f"buffer{'s' if len(missing) > 1 else ''} ({names})")
        if strict:
            raise KeyError(
                f"{what}: they would keep the values the model was built with, where "
                "load_state_dict reports them as missing keys. Check that the checkpoint is the "
                "model's, or pass strict=False to keep those values")
        warnings.warn(f"{what}: they keep the values the model was built with (strict=False)", stacklevel=4)
    return keys
