"""The one layout grammar every part of Keel reads."""

import pytest

from common.layout import AXES, Layout, LayoutError, parse_axes


def test_text_names_axes_in_any_order_and_the_canonical_form_orders_them():
    layout = Layout.parse("tp=2, dp_shard=4")
    assert layout == Layout(dp_shard=4, tp=2) and layout.world_size == 8 and layout.dp_size == 4
    assert str(layout) == "dp_shard=4,tp=2"
    assert str(Layout.parse(str(layout))) == str(layout)
    assert parse_axes("tp=2, dp_shard=4") == {"tp": 2, "dp_shard": 4}


def test_with_a_world_size_empty_means_every_rank_sharded_and_sizes_must_multiply():
    assert parse_axes("", 4) == {"dp_shard": 4}
    assert Layout.parse(None, 4) == Layout(dp_shard=4)
    with pytest.raises(
        LayoutError, match="spans 4 ranks but WORLD_SIZE=2; make the sizes multiply"
    ):
        Layout.parse("dp_shard=4", 2, source="KEEL_MESH")
    with pytest.raises(LayoutError, match="empty layout"):
        Layout.parse("")


@pytest.mark.parametrize(
    "text, source, message",
    [
        (
            "cp=2",
            None,
            "layout 'cp=2': 'cp=2' is not NAME=SIZE with NAME one of " + ", ".join(AXES),
        ),
        ("tp=0", "--layout", "--layout='tp=0': 'tp=0' is not NAME=SIZE"),
        ("tp=2,tp=2", None, "layout 'tp=2,tp=2' gives tp twice; give each axis once"),
    ],
)
def test_errors_name_where_the_text_came_from_and_the_fix(text, source, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        Layout.parse(text, source=source)


def test_ranks_are_laid_out_pp_outermost_and_tp_innermost():
    layout = Layout(dp_shard=2, tp=2, pp=2)
    assert [
        tuple(layout.coordinates(r)[a] for a in ("pp", "dp_shard", "tp")) for r in range(8)
    ] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
