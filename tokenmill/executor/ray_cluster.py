"""The Ray side of a multi-host engine: join the cluster, reserve one bundle of devices per host,
order the workers, and the environment they start with.

How many hosts: the hosts are taken to be alike, each offering as many devices as the driver's node
has of the device resource (TOKENMILL_RAY_DEVICE_RESOURCE; "GPU" on GPU hosts). An engine of
tensor_parallel_size T on hosts of D devices spans T / D hosts (one, of T devices, when T <= D); T
must then be a multiple of D. One bundle per host (STRICT_SPREAD), the first pinned to the driver's
node, so rank 0 (and JAX's coordinator) runs beside the engine.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections import Counter
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from tokenmill.worker.worker import NodeInfo

logger = logging.getLogger(__name__)

# Copied from the driver to every worker: what shapes how JAX and tokenmill run there...
COPIED_ENV_PREFIXES = ("TOKENMILL_", "JAX_")
COPIED_ENV = ("XLA_FLAGS",)
# ...except what names one process's own place in a job, and the driver's own choice of backend.
PER_PROCESS_ENV = frozenset({
    "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_PROCESS_ID",
    "JAX_NUM_PROCESSES", "JAX_LOCAL_DEVICE_IDS", "TOKENMILL_MULTIHOST_BACKEND",
})
# a sliver of the driver node's own `node:<ip>` resource pins a bundle there
NODE_PIN = 0.001


def connect(device_resource: str, local_devices: int) -> None:
    """Join the running cluster (RAY_ADDRESS or the local one), else start a one-host cluster here
    that offers `local_devices` of `device_resource`."""
    # Ray reports usage to its developers unless told not to; the user's own setting wins
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto")
    except ConnectionError as e:
        if address := os.environ.get("RAY_ADDRESS"):  # the user named a cluster: not finding it is an error
            raise ConnectionError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {e}") from e
        logger.warning(
            "no running Ray cluster found (start one with `ray start --head` or set RAY_ADDRESS): starting a "
            "local one, which spans this host only"
        )
        # Ray finds GPUs itself; a custom device resource must be declared
        ray.init(resources=None if device_resource == "GPU" else {device_resource: local_devices})


@dataclass(frozen=True)
class HostPlan:
    driver: NodeInfo
    devices_per_host: int
    num_hosts: int
    device_resource: str

    def bundles(self) -> list[dict[str, float]]:
        bundles = [{self.device_resource: float(self.devices_per_host)} for _ in range(self.num_hosts)]
        bundles[0][f"node:{self.driver.ip}"] = NODE_PIN
        return bundles

    def describe(self) -> str:
        return (f"{self.num_hosts} host(s) x {self.devices_per_host} '{self.device_resource}' (one bundle per "
                f"host, the first on the driver's node {self.driver.ip})")


def plan_hosts(tensor_parallel_size: int, device_resource: str) -> HostPlan:
    context = ray.get_runtime_context()
    driver_id = context.get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == driver_id)
    driver = NodeInfo(node["NodeManagerAddress"], driver_id, ())
    offered = node["Resources"].get(device_resource, 0)
    if offered < 1:
        raise RuntimeError(
            f"the driver's Ray node {driver.ip} has no '{device_resource}' resource, but the engine's rank 0 "
            f"runs there; start Ray on it with its devices "
            f"(e.g. `ray start --resources='{{\"{device_resource}\": N}}'`), or run the engine on a node that "
            f"has them (TOKENMILL_RAY_DEVICE_RESOURCE names the resource). "
            f"{cluster_summary(device_resource)}"
        )
    per_host = min(int(offered), tensor_parallel_size)
    if tensor_parallel_size % per_host:
        raise RuntimeError(
            f"tensor_parallel_size={tensor_parallel_size} is not a multiple of the {per_host} '{device_resource}' "
            f"of each host (the driver's node {driver.ip} offers {offered:g}; hosts are taken to be alike)"
        )
    return HostPlan(driver, per_host, tensor_parallel_size // per_host, device_resource)


def cluster_summary(device_resource: str) -> str:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    per_node = ", ".join(f"{n['NodeManagerAddress']}: {n['Resources'].get(device_resource, 0):g}" for n in nodes)
    return f"The cluster has {len(nodes)} alive node(s), '{device_resource}' per node: {per_node or 'none'}."


def reserve_hosts(plan: HostPlan, timeout_s: float) -> PlacementGroup:
    group = placement_group(plan.bundles(), strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve {plan.describe()} within {timeout_s:g} s "
            f"(TOKENMILL_RAY_PLACEMENT_TIMEOUT_S). {cluster_summary(plan.device_resource)} "
            f"Add hosts, or lower tensor_parallel_size."
        ) from None
    return group


def _ip_order(ip: str):
    try:
        address = ipaddress.ip_address(ip)
        return (address.version, int(address), ip)
    except ValueError:  # a host name
        return (99, 0, ip)


def rank_order(infos: list[NodeInfo], driver_node_id: str) -> list[int]:
    """Indices of `infos` in rank order: the driver's node first, then nodes with fewer workers,
    then by IP address."""
    per_node = Counter(info.node_id for info in infos)
    return sorted(range(len(infos)), key=lambda i: (
        infos[i].node_id != driver_node_id, per_node[infos[i].node_id], _ip_order(infos[i].ip)))


def node_device_ids(infos: list[NodeInfo]) -> dict[str, list[str]]:
    """Per node, the device ids Ray assigned to the workers there, for each of them to see."""
    ids: dict[str, set[str]] = {}
    for info in infos:
        ids.setdefault(info.node_id, set()).update(info.device_ids)
    return {node: sorted(found, key=lambda d: (len(d), d)) for node, found in ids.items()}


def worker_env(environ=os.environ) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if (k.startswith(COPIED_ENV_PREFIXES) or k in COPIED_ENV) and k not in PER_PROCESS_ENV}
