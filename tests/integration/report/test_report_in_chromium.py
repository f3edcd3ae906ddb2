"""The HTML report as a reader sees it: opened in headless Chromium (Debian's `chromium` package), with the network
blocked. Every chart must load and the page must not render blank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from deepserve.report.build import build_report, load_sets
from deepserve.report.deployment import DeploymentOptions
from deepserve.results.slo import Slo

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed; install Debian's package: apt-get install -y chromium",
)

# Reports each <img>'s natural width once the page has loaded, into the DOM that --dump-dom prints.
IMAGE_CHECK = (
    "<script>window.addEventListener('load', () => {"
    "const found = [...document.images].map(i => ({alt: i.alt, width: i.naturalWidth}));"
    "const out = document.createElement('pre'); out.id = 'image-check'; out.textContent = JSON.stringify(found);"
    "document.body.appendChild(out);});</script>"
)


def chromium(profile: Path, *args: str) -> str:
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",  # tests may run as root in containers
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: the report must need none
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def loaded_images(html_path: Path, profile: Path) -> list[dict]:
    """Natural widths of the page's images. The check script runs from a copy whose policy also allows inline
    scripts; images stay restricted to data: URIs, as in the report itself."""
    html = html_path.read_text()
    assert "img-src data:" in html
    checked = html.replace("default-src 'none'", "default-src 'none'; script-src 'unsafe-inline'")
    checked = checked.replace("</body>", IMAGE_CHECK + "</body>")
    copy = html_path.with_name("checked.html")
    copy.write_text(checked)
    dom = chromium(profile, "--virtual-time-budget=10000", "--dump-dom", copy.as_uri())
    match = re.search(r'<pre id="image-check">(.*?)</pre>', dom, re.S)
    assert match, "the page never finished loading"
    return json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("report")
    names = (
        "h100_vllm_concurrency",
        "h100_sglang_concurrency",
        "h100_v3_rate",
        "h100_r1_rate",
        "h200_vllm_output_length",
        "h200_vllm_prefix",
    )
    # a price, so that the cost chart is drawn too (the Pareto and hardware-limit charts come from the fixtures' own
    # hardware records)
    options = DeploymentOptions(gpu_hour_usd=2.0)
    return build_report(load_sets([FIXTURES / name for name in names]), out, [Slo("p99_itl_ms", 50)], None, options)


def test_every_chart_loads(report, tmp_path: Path):
    images = loaded_images(report.html_path, tmp_path / "profile")
    assert len(images) == len(report.charts) >= 7
    assert all(image["width"] > 0 for image in images), images
    assert {image["alt"] for image in images} == {chart.title for chart in report.charts}
    names = {chart.name for chart in report.charts}
    assert {"pareto", "cost_per_million_tokens", "decode_vs_hardware_limit"} <= names


def test_a_broken_chart_is_caught(report, tmp_path: Path):
    """The check itself can fail: an image whose data is cut short does not load."""
    broken = tmp_path / "report.html"
    html = report.html_path.read_text()
    start = html.index("data:image/png;base64,") + len("data:image/png;base64,")
    broken.write_text(html[:start] + "iVBORw0KGgo" + html[html.index('"', start) :])
    widths = [image["width"] for image in loaded_images(broken, tmp_path / "profile")]
    assert widths[0] == 0 and all(width > 0 for width in widths[1:])


def test_screenshot_is_not_blank(report, tmp_path: Path):
    shot = tmp_path / "shot.png"
    chromium(tmp_path / "profile", "--window-size=1280,2400", f"--screenshot={shot}", report.html_path.as_uri())
    image = matplotlib.image.imread(shot)
    assert image.shape[1] == 1280
    not_white = np.any(image[:, :, :3] < 0.9, axis=2).mean()
    assert not_white > 0.05, f"only {not_white:.1%} of the screenshot is not white"
    colours = len(np.unique((image[:, :, :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert colours > 50  # text alone is a few greys; the charts bring their colours
