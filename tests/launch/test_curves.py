"""reward_curve.png: the parity panel is on a log scale, shows an exact 0 on a marked floor and a
non-zero difference above it, and says the mismatches in text."""

from __future__ import annotations

from pathlib import Path

from tonpolicy.launch.curves import EXACT_FLOOR, _pyplot, parity_panel, reward_curve

RECORDS = [
    {"step": 0, "reward_mean": 0.25, "max_abs_logprob_diff": 0.0, "mismatched_tokens": 0, "tokens_scored": 32},
    {"step": 1, "reward_mean": 0.5, "max_abs_logprob_diff": 3.0e-6, "mismatched_tokens": 2, "tokens_scored": 32},
]


def test_parity_panel_is_log_scaled_with_an_exact_floor() -> None:
    plt = _pyplot()
    fig, ax = plt.subplots()
    parity_panel(ax, RECORDS)
    assert ax.get_yscale() == "log"
    ys = list(ax.get_lines()[-1].get_ydata())
    assert ys == [EXACT_FLOOR, 3.0e-6]  # the exact step on the floor, the other well above it
    texts = [t.get_text() for t in ax.texts]
    assert "exact 0" in texts and "0/32" in texts and "2/32" in texts
    assert "mismatched tokens 2 of 64" in ax.get_title()  # mismatches as text
    plt.close(fig)


def test_reward_curve_renders(tmp_path: Path) -> None:
    path = reward_curve(RECORDS, tmp_path / "reward_curve.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
