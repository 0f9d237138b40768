"""A target's decoder layers kept in host memory and streamed to the device a layer at a time
(``--offload``): targets larger than the device's memory are served at the speed of the host-to-device
link. A pass then costs about the same for a thousand rows as for one (every layer's weights cross the
link once a pass), which is the regime where trees of hundreds of nodes pay (SpecInfer, SpecExec).

Two device slots hold one layer each: while layer i computes from one, layer i + 1's copy fills the other
on a side stream; a slot is refilled only after the layer that used it has finished. The KV cache, the
embeddings, the final norm and the LM head stay on the device. On a CPU the same path copies host to host
(what the tests exercise).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from specmesh.runtime.llama import Linear, _Layer

SlotLinear = Callable[[torch.Tensor, torch.Tensor | None], Linear]  # (weight, bias) -> a linear computing from them


def layer_tensors(layer: _Layer) -> list[torch.Tensor]:
    """Every tensor a layer computes from, in one fixed order."""
    tensors = [layer.input_norm, layer.post_norm]
    for linear in (layer.qkv, layer.out, layer.gate_up, layer.down):
        tensors.append(linear.weight)
        if linear.bias is not None:
            tensors.append(linear.bias)
    return tensors


def layer_over(layer: _Layer, tensors: list[torch.Tensor], linear: SlotLinear) -> _Layer:
    """A layer shaped as ``layer`` computing from ``tensors`` (in ``layer_tensors``' order)."""
    values = iter(tensors)
    input_norm, post_norm = next(values), next(values)
    linears = [linear(next(values), next(values) if part.bias is not None else None)
               for part in (layer.qkv, layer.out, layer.gate_up, layer.down)]
    return _Layer(input_norm, linears[0], linears[1], post_norm, linears[2], linears[3])


def host_layer(layer: _Layer, device: torch.device, linear: SlotLinear) -> _Layer:
    """``layer`` as it waits in host memory: its tensors pinned where ``device`` is a GPU (so that copies
    run asynchronously), as they are on a CPU."""
    if device.type != "cuda":
        return layer
    return layer_over(layer, [t.pin_memory() for t in layer_tensors(layer)], linear)


class StreamedLayers:
    """``host`` layers (see ``host_layer``) computed on ``device`` through two slots. Indexing gives the
    host layers (shapes, kinds); ``streamed()`` gives each layer on the device."""

    def __init__(self, host: list[_Layer], device: torch.device, linear: SlotLinear) -> None:
        cuda = device.type == "cuda"
        self.host = host
        first = layer_tensors(self.host[0])
        self.slots = [layer_over(self.host[0], [torch.empty_like(t, device=device) for t in first], linear)
                      for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copied = [torch.cuda.Event() for _ in range(2)] if cuda else []  # the slot holds its next layer
        self.freed = [torch.cuda.Event() for _ in range(2)] if cuda else []  # its last layer has computed
        self.streamed_bytes = 0  # weights copied into the slots so far: what proves a pass streamed

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, index: int) -> _Layer:
        return self.host[index]

    @property
    def layer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in layer_tensors(self.host[0]))

    def streamed(self) -> Iterator[_Layer]:
        """Each layer in turn, on the device; the caller enqueues its work before asking for the next."""
        self._fill(0, 0)
        for index in range(len(self.host)):
            slot = index % 2
            if index + 1 < len(self.host):
                self._fill(index + 1, 1 - slot)
            if self.stream is not None:
                torch.cuda.current_stream().wait_event(self.copied[slot])
            yield self.slots[slot]
            if self.stream is not None:
                self.freed[slot].record()  # after this layer's work, on the compute stream

    def _fill(self, index: int, slot: int) -> None:
        pairs = list(zip(layer_tensors(self.slots[slot]), layer_tensors(self.host[index])))
        self.streamed_bytes += sum(source.numel() * source.element_size() for _, source in pairs)
        if self.stream is None:
            for target, source in pairs:
                target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.freed[slot])  # never recorded yet: no wait
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
            self.copied[slot].record(self.stream)
