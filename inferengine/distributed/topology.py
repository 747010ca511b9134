"""Where each rank runs and how it reaches the others, for the start-up log.

A rank's place is its node (a host, or a Ray node id) and device; two ranks on one node reach
each other over NVLink or PCIe peer access on GPUs (read from NVML, else torch's peer check),
over gloo on the CPU, and over the network (NCCL or gloo sockets) between nodes.
"""

from __future__ import annotations

import torch

from inferengine.distributed.parallel_state import gather_objects
from inferengine.logger import init_logger

logger = init_logger(__name__)


def device_label(device: torch.device) -> str:
    """`cpu`, or `cuda:0 NVIDIA H100 80GB HBM3 (bus 0000:1b:00.0)`."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{device.index} {torch.cuda.get_device_name(device)} (bus {pci_bus_id(device)})"


def pci_bus_id(device: torch.device) -> str:
    """The GPU's PCI address, as NVML spells it (`0000:1b:00.0`), or `?` where torch lacks it."""
    props = torch.cuda.get_device_properties(device)
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if None in parts:
        return "?"
    domain, bus, dev = parts
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def peer_links(node: str, device: torch.device) -> dict[int, str]:
    """This rank's link to every other rank, by rank: `NVLink`, `PCIe P2P`, `no P2P` (copies
    through the host), `cpu/gloo` (CPU ranks of one node), or `network` (another node). A
    collective: every rank calls it."""
    bus = pci_bus_id(device) if device.type == "cuda" else ""
    places = gather_objects((node, bus))
    links: dict[int, str] = {}
    for rank, (other_node, other_bus) in enumerate(places):
        if (other_node, other_bus) == (node, bus):
            continue
        if other_node != node:
            links[rank] = "network"
        elif device.type != "cuda":
            links[rank] = "cpu/gloo"
        else:
            links[rank] = _gpu_link(device, other_bus)
    return links


def _gpu_link(device: torch.device, other_bus: str) -> str:
    nvlink = _nvml_nvlink(pci_bus_id(device), other_bus)
    if nvlink:
        return "NVLink"
    peer = _visible_index(other_bus)
    if peer is None:
        return "unknown (peer GPU not visible)"
    if torch.cuda.can_device_access_peer(device, peer):
        return "PCIe P2P" if nvlink is False else "P2P"
    return "no P2P"


def _visible_index(bus: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if pci_bus_id(torch.device("cuda", i)) == bus:
            return i
    return None


def _nvml_nvlink(bus: str, other_bus: str) -> bool | None:
    """Whether NVML reports NVLink peer-to-peer between the two GPUs; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            a = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            b = pynvml.nvmlDeviceGetHandleByPciBusId(other_bus)
            status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            return status == pynvml.NVML_P2P_STATUS_OK
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # no pynvml, no driver, an old NVML: torch's check decides
        logger.debug("NVML could not tell the link between %s and %s: %s", bus, other_bus, e)
        return None
