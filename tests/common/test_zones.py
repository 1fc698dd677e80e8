"""One zone spelling for every service, in the proto enum's order."""
from __future__ import annotations

import pytest
from gpuplane.governor.v1 import governor_pb2

from services.common.errors import InvalidArgument
from services.common.zones import ZONES, zone_name, zone_value


def test_zone_names_follow_the_proto_enum_value_for_value():
    for value in range(1, len(ZONES) + 1):
        proto = governor_pb2.Zone.Name(value).removeprefix("ZONE_").lower()
        assert zone_name(value) == proto and zone_value(proto) == value, proto
    assert len(governor_pb2.Zone.values()) == len(ZONES) + 1, "a proto zone has no Python name"


@pytest.mark.parametrize("value", [0, len(ZONES) + 1, -1])
def test_an_unspecified_or_unknown_zone_value_is_a_bad_request(value):
    with pytest.raises(InvalidArgument, match="unspecified or unknown"):
        zone_name(value)


def test_an_unknown_zone_name_is_a_bad_request():
    with pytest.raises(InvalidArgument, match="unknown"):
        zone_value("heap")
