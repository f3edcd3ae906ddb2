"""The tune's grid: values parsed and checked by EngineConfig's own field types, clear errors, expansion and ids."""

from __future__ import annotations

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.tune.grid import expand, parse_axis, parse_setting, point_id


def test_values_take_the_fields_types():
    assert parse_axis("max_num_seqs=2,16,256").values == (2, 16, 256)
    assert parse_axis("gpu_memory_utilization=0.8, 0.95").values == (0.8, 0.95)
    assert parse_axis("enable_chunked_prefill=true,false").values == (True, False)
    assert parse_axis("engine=vllm,sglang").values == ("vllm", "sglang")
    assert parse_axis("max-num-batched-tokens=512").field == "max_num_batched_tokens"


def test_default_leaves_an_optional_field_to_the_engine():
    assert parse_axis("max_num_seqs=default,64").values == (None, 64)
    with pytest.raises(ConfigError, match="tensor_parallel_size has no engine default"):
        parse_axis("tensor_parallel_size=default,2")


def test_list_fields_take_a_shell_quoted_argument_list():
    axis = parse_axis("extra_args=--enforce-eager,--block-size 32 --swap-space 0")
    assert axis.values == (["--enforce-eager"], ["--block-size", "32", "--swap-space", "0"])


def test_unknown_field_lists_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        parse_axis("max_seqs=2,4")
    message = str(error.value)
    assert "unknown engine-config field 'max_seqs'" in message
    assert "max_num_seqs" in message and "max_num_batched_tokens" in message
    assert ", port" not in message  # the tune sets the port itself


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("max_num_seqs=2,abc", "'abc' is not a valid max_num_seqs"),
        ("max_num_seqs=0", "'0' is not a valid max_num_seqs (Input should be greater than or equal to 1)"),
        ("gpu_memory_utilization=1.5", "not a valid gpu_memory_utilization"),
        ("engine=tgi", "not a valid engine"),
        ("max_num_seqs", "must look like FIELD=V1,V2"),
        ("max_num_seqs=", "needs at least one value"),
        ("max_num_seqs=4,4", "lists a value twice"),
        ("port=8000,8001", "free loopback port"),
    ],
)
def test_bad_grids_say_what_is_wrong(text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_axis(text)


def test_set_fixes_one_field():
    assert parse_setting("max_model_len=4096") == ("max_model_len", 4096)
    assert parse_setting("model=tiny") == ("model", "tiny")
    with pytest.raises(ConfigError, match="must look like FIELD=VALUE"):
        parse_setting("tiny")


def test_expansion_is_every_combination_with_the_first_axis_slowest():
    base = EngineConfig(model="tiny", max_model_len=512)
    points = expand([parse_axis("max_num_seqs=2,16"), parse_axis("max_num_batched_tokens=512,2048")], base)
    assert [(p.config.max_num_seqs, p.config.max_num_batched_tokens) for p in points] == [
        (2, 512),
        (2, 2048),
        (16, 512),
        (16, 2048),
    ]
    assert all(p.config.model == "tiny" and p.config.max_model_len == 512 for p in points)
    assert points[1].describe() == "max_num_seqs=2 max_num_batched_tokens=2048"
    assert len({p.point_id for p in points}) == 4


def test_a_field_given_twice_is_refused():
    with pytest.raises(ConfigError, match="given twice"):
        expand([parse_axis("max_num_seqs=2"), parse_axis("max_num_seqs=4")], EngineConfig())


def test_point_ids_are_readable_stable_and_distinct():
    one = point_id({"max_num_seqs": 16, "max_num_batched_tokens": 512})
    assert one.startswith("mns16-mnbt512-")
    assert one == point_id({"max_num_seqs": 16, "max_num_batched_tokens": 512})
    assert one != point_id({"max_num_seqs": 16, "max_num_batched_tokens": 513})
    assert point_id({"max_num_seqs": None}).startswith("mnsdefault-")
    assert point_id({"max_num_seqs": None}) != point_id({"max_num_seqs": 256})


def test_multi_node_fields_are_not_tuned():
    with pytest.raises(ConfigError, match="on this machine alone"):
        parse_axis("nnodes=1,2")
    with pytest.raises(ConfigError, match="on this machine alone"):
        parse_setting("master_addr=10.0.0.1")


def test_a_fields_own_choice_named_none_is_not_its_default():
    """speculative_method=none turns speculation off; only for fields without such a choice does `none` mean the
    engine's default."""
    from deepserve.tune.grid import parse_axis

    assert parse_axis("speculative_method=none,mtp,auto").values == ("none", "mtp", "auto")
    assert parse_axis("num_speculative_tokens=0,1,2,3").values == (0, 1, 2, 3)
    assert parse_axis("max_num_seqs=none,8").values == (None, 8)
