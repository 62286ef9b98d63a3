"""A comm check's measurements read back (``python -m tools.checks.comm_check --out FILE``), and the time they give
a step's collectives on a group of any size.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from common.collectives import ring_link_bytes


@dataclass(frozen=True)
class CommCheck:
    """What ``tools.checks.comm_check`` measured (its JSON): the slowest rank's seconds per collective kind and size.

    A collective of S bytes takes the measured time at S when S was measured. Between two measured
    sizes the time is interpolated linearly in S: a collective costs about a latency plus S over a
    bandwidth, a straight line through both neighbours, where the bandwidth of the nearest size
    would give a 3 MiB message that of 2 MiB or of 4 MiB. Small messages are latency-bound, so
    the bandwidth of a 1 GB message would overstate a 25 MB bucket's. Below the smallest size
    measured, that size's time (a smaller message takes no longer, and is latency-bound); above the
    largest, the largest's bus bandwidth (large messages are bandwidth-bound).
    """

    world_size: int
    nodes: int
    backend: str
    device_name: str
    times: dict[str, list[tuple[int, float]]]

    @classmethod
    def load(cls, path: Path) -> CommCheck:
        """Raises ValueError, naming what is wrong, for a file that is not a comm check's."""
        try:
            data = json.loads(path.read_text())
            times: dict[str, list[tuple[int, float]]] = {}
            for row in data["results"]:
                times.setdefault(row["op"], []).append((int(row["bytes"]), float(row["time_s"])))
            sorted_times = {kind: sorted(points) for kind, points in times.items()}
            check = cls(int(data["world_size"]), int(data["nodes"]), data["backend"], data["device_name"], sorted_times)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"not a comm check's JSON (python -m tools.checks.comm_check --out FILE): {err!r}"
            ) from err
        if check.world_size < 2:
            raise ValueError("it measured one rank: nothing crossed a link")
        if not times or any(seconds <= 0 for points in times.values() for _, seconds in points):
            raise ValueError("it holds no measurement, or a time that is not positive")
        return check

    def label(self) -> str:
        return f"{self.world_size} ranks on {self.nodes} node(s), {self.backend}"

    def check_seconds(self, kind: str, message_bytes: int) -> float:
        """The time of one ``kind`` of ``message_bytes`` on the ranks that the check measured."""
        points = self.times[kind]
        sizes = [size for size, _ in points]
        if message_bytes <= sizes[0]:
            return points[0][1]
        if message_bytes >= sizes[-1]:
            return points[-1][1] * message_bytes / sizes[-1]  # the largest's bandwidth
        above = bisect.bisect_left(sizes, message_bytes)
        (low, t_low), (high, t_high) = points[above - 1], points[above]
        return t_low + (t_high - t_low) * (message_bytes - low) / (high - low)

    def seconds(self, kind: str, message_bytes: int, group_size: int) -> float:
        """One collective on a group of ``group_size``: its link bytes over the bus bandwidth measured at its size.

        Bus bandwidth is the same whatever the number of ranks (nccl-tests' point), and a rank's link
        bytes are what it is multiplied by (``ring_link_bytes``).
        """
        share = ring_link_bytes(kind, message_bytes, group_size) / ring_link_bytes(kind, message_bytes, self.world_size)
        return self.check_seconds(kind, message_bytes) * share

    def step_seconds(self, collectives: Iterable[tuple[str, int, int]]) -> float | None:
        """Sum over a step's collectives; None if one of their kinds was not measured."""
        collectives = list(collectives)
        if any(kind not in self.times for kind, _, _ in collectives):
            return None
        return sum(self.seconds(kind, size, group) for kind, size, group in collectives)
