"""The bound on what one request body costs before it is parsed (issue 38, item 4): the
byte count of its values, and the lane that takes costly bodies one at a time."""

from __future__ import annotations

import asyncio
import json

from flowdecision.core.jsonwire import count_items
from flowdecision.service.handlers import BodyLane


def test_count_items_counts_containers_and_commas_outside_strings() -> None:
    assert count_items(b"1") == 0
    assert count_items(b"[1,2,{}]") == 4  # two containers, two commas
    assert count_items(b'{"a":"x,[{","b":[1,2]}') == 4  # the string's text is not counted
    # Escaped quotes and backslashes do not end a string.
    assert count_items(json.dumps(['a\\"[,{', "\\", "[", {"k": ","}]).encode()) == 5
    deep = b"[" * 100 + b"]" * 100
    assert count_items(b"[" + b",".join([deep] * 50) + b"]") == 1 + 50 * 100 + 49


async def test_the_lane_takes_one_costly_body_at_a_time() -> None:
    lane = BodyLane()
    inside = 0
    most = 0
    order: list[int] = []

    async def costly(n: int) -> None:
        nonlocal inside, most
        async with lane.turn():
            inside += 1
            most = max(most, inside)
            order.append(n)
            await asyncio.sleep(0.001)
            inside -= 1

    await asyncio.gather(*(costly(n) for n in range(5)))
    assert most == 1 and sorted(order) == list(range(5))
