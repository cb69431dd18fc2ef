import math
import xml.etree.ElementTree as ET

from kiln.report.charts import (Chart, Marker, Series, bar_chart, column_chart, downsample, json_script, log_ticks,
                                nice_ticks, render_chart)

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # also proves the SVG is well-formed XML


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(2.31, 5.62)
    assert ticks == [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]
    assert nice_ticks(3.0, 3.0) == [3.0]
    assert log_ticks(1e-4, 1e-1) == [1e-4, 1e-3, 1e-2, 1e-1]
    assert log_ticks(3e-3, 8e-3) == [5e-3]


def test_downsample_keeps_extremes_and_order():
    xs = list(range(10_000))
    ys = [math.sin(i / 100) for i in xs]
    ys[7777] = 50.0  # a spike must survive
    ys[1234] = -50.0
    dx, dy = downsample(xs, ys, 400)
    assert len(dx) <= 400
    assert dx == sorted(dx)
    assert 50.0 in dy and -50.0 in dy
    assert all(ys[x] == y for x, y in zip(dx, dy))
    assert downsample([1, 2], [3, 4], 400) == ([1, 2], [3, 4])


def test_downsample_survives_all_nan_buckets():
    xs = list(range(100))
    ys = [math.nan] * 50 + [float(i) for i in range(50)]
    dx, dy = downsample(xs, ys, 10)
    assert len(dx) <= 10 and 49.0 in dy


def test_chart_has_id_paths_gaps_markers_and_escaped_text():
    chart = Chart("chart-x", "Loss <&>", [
        Series("a<b", [1, 2, 3, 4, 5], [1.0, 2.0, math.nan, 4.0, 5.0]),
        Series("pts", [1, 5], [2.0, 3.0], style="points"),
    ], markers=[Marker(3, "checkpoint step 3")])
    svg = render_chart(chart)
    root = parse(svg)
    assert root.get("id") == "chart-x"
    paths = root.findall(f".//{SVG}path")
    assert len(paths) == 1
    d = paths[0].get("d")
    assert d.count("M") == 2 and d.count("L") == 2  # the NaN splits the line in two
    assert len(root.findall(f".//{SVG}circle")) == 2
    markers = [e for e in root.iter(f"{SVG}line") if e.get("class") == "marker"]
    assert len(markers) == 1 and markers[0].find(f"{SVG}title").text == "checkpoint step 3"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "Loss <&>" in texts and "a<b" in texts  # escaped in the source, intact after parsing


def test_points_map_monotonically_and_stay_inside_the_frame():
    chart = Chart("c", "t", [Series("s", [0, 10, 20], [1.0, 3.0, 2.0])], width=400, height=200)
    root = parse(render_chart(chart))
    frame = next(e for e in root.iter(f"{SVG}rect") if e.get("class") == "frame")
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    x1, y1 = x0 + float(frame.get("width")), y0 + float(frame.get("height"))
    coords = [tuple(map(float, p.lstrip("ML").split(","))) for p in root.find(f".//{SVG}path").get("d").split()]
    assert [c[0] for c in coords] == sorted(c[0] for c in coords)
    assert coords[1][1] < coords[2][1] < coords[0][1]  # larger y is higher on screen
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in coords)


def test_log_axes_drop_nonpositive_values_and_empty_charts_say_so():
    chart = Chart("c", "t", [Series("s", [1, 2, 3], [0.0, 10.0, 100.0])], log_y=True)
    d = parse(render_chart(chart)).find(f".//{SVG}path").get("d")
    assert d.count("L") == 1  # the 0 cannot be drawn on a log axis
    empty = parse(render_chart(Chart("e", "t", [Series("s", [], [])])))
    assert any(t.text == "no data" for t in empty.iter(f"{SVG}text"))
    constant = parse(render_chart(Chart("k", "t", [Series("s", [1, 2], [5.0, 5.0])])))
    assert constant.find(f".//{SVG}path") is not None


def test_categorical_ticks():
    chart = Chart("c", "t", [Series("s", [0, 1], [1.0, 2.0], style="points")], x_ticks=[(0, "adamw"), (1, "lion")])
    texts = [t.text for t in parse(render_chart(chart)).iter(f"{SVG}text")]
    assert "adamw" in texts and "lion" in texts


def test_bar_chart_scales_to_the_largest_value_and_escapes_labels():
    root = parse(bar_chart([("input", 200, "200 docs"), ("<b>step</b>", 50, "50 docs")], "#3182bd"))
    widths = [float(r.get("width")) for r in root.iter(SVG + "rect")]
    assert widths == [640.0, 160.0]
    assert [t.text for t in root.iter(SVG + "text")][2] == "<b>step</b>"  # escaped in the source, text once parsed
    assert float(parse(bar_chart([("none", 0, "0")], "#000")).find(SVG + "rect").get("width")) == 1.0


def test_column_chart_groups_side_by_side():
    root = parse(column_chart(["0 B", "≥1 KiB"], [("before", [4, 8], "#9ecae1"), ("kept", [2, 0], "#3182bd")],
                              unit="documents"))
    columns = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert [float(r.get("height")) for r in columns] == [90.0, 45.0, 180.0, 0.0]
    assert columns[0].find(SVG + "title").text == "4 documents"
    assert float(columns[1].get("x")) > float(columns[0].get("x"))  # the second group sits to the right
    assert "≥1 KiB" in [t.text for t in root.iter(SVG + "text")]


def test_json_script_cannot_be_closed_from_inside():
    html = json_script("data-x", {"name": "</script><script>alert(1)</script>"})
    assert html.count("</script>") == 1 and html.endswith("</script>")
