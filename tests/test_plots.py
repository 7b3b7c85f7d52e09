"""The evaluate stage's PNG plots."""

from kvpop.plots import plot_accuracy_vs_budget, plot_memory_curve

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_memory_curve(tmp_path):
    curves = {"dense": [(0, 1.0), (64, 1.5), (128, 2.0)], "streaming_llm": [(0, 0.5), (64, 0.5), (128, 0.5)]}
    out = plot_memory_curve(curves, tmp_path / "sub" / "memory.png")
    assert out == tmp_path / "sub" / "memory.png"
    data = out.read_bytes()
    assert data.startswith(PNG) and 1_000 < len(data) < 500_000


def test_plot_accuracy_vs_budget(tmp_path):
    points = {
        "kvpop_mlp": [(512, 0.8), (128, 0.4), (256, 0.6)],  # unsorted (earlier experiments + this run)
        "tova": [(256, 0.5)],  # a single point
        "h2o": [],  # nothing yet: skipped
    }
    out = plot_accuracy_vs_budget(points, str(tmp_path / "acc.png"), "pass@1")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 1_000
    assert plot_accuracy_vs_budget({}, tmp_path / "empty.png", "quote_accuracy").stat().st_size > 0
