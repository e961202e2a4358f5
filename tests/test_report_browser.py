"""The run report opened in a real browser (Debian's headless Chromium through its chromedriver,
driven by selenium): the page runs without a console error, draws its charts, its sample browser's
filters change the rows shown and a known response is on the page. scripts/install.sh installs
Chromium where it is missing; without it (and no way to install it) the test is skipped, saying so."""
import contextlib
import io
import os
import shutil
import subprocess

import pytest

from roll_gspo.report import write_report
from tests.report_fixtures import KNOWN_RESPONSE, PAID_WRONG_RESPONSE, make_run

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (setup.py's dev extra) is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")


def chromium_or_skip() -> None:
    """Chromium and its driver, installed with apt when missing and allowed (root); else skip."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
        try:
            if subprocess.run(install, capture_output=True, timeout=600).returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
                subprocess.run(install, capture_output=True, timeout=600)
        except subprocess.TimeoutExpired:
            pass  # no mirror reachable: skipped below
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed and could not be installed "
                    "(scripts/install.sh installs them as root with apt-get)")


@contextlib.contextmanager
def browser_for(profile_parent):
    """Headless Chromium with a fresh profile under `profile_parent`, quit on leaving (skips the
    calling test where Chromium is missing and cannot be installed)."""
    chromium_or_skip()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={os.path.join(str(profile_parent), 'chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with browser_for(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    first = make_run(str(root / "run_a"))
    second = make_run(str(root / "run_b"), steps=30, rollouts=False)
    return write_report(first, [second])


def open_page(driver, path):
    driver.get("file://" + os.path.abspath(path))
    driver.implicitly_wait(0)
    assert driver.execute_script("return document.body.getAttribute('data-ready')") == "true", \
        "the page's script did not run to its end"


def severe(driver):
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_the_page_opens_without_a_console_error_and_draws_its_charts(browser, report):
    open_page(browser, report)
    assert severe(browser) == []
    paths = browser.execute_script(
        "return [...document.querySelectorAll('#charts svg path.series')].map(p => p.getAttribute('d'))")
    assert len(paths) >= 10 and all(d.count("L") >= 5 for d in paths[:3]), paths[:3]
    assert browser.execute_script("return document.querySelectorAll('.timeline-svg rect').length") > 100
    assert browser.execute_script("return document.querySelectorAll('.timeline-svg .stall-mark').length") == 2  # step 17 of each run
    from PIL import Image

    charts = browser.find_element("id", "charts")
    browser.execute_script("arguments[0].scrollIntoView()", charts)
    image = Image.open(io.BytesIO(charts.screenshot_as_png)).convert("RGB")
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20)} if image.getcolors(maxcolors=1 << 20) else set()
    assert len(colours) > 20, "the chart region is blank"


def test_a_filter_changes_the_rows_and_a_known_response_is_shown(browser, report):
    open_page(browser, report)
    count = "return document.querySelectorAll('#sample-rows .sample').length"
    assert browser.execute_script(count) == 64
    assert KNOWN_RESPONSE in browser.find_element("id", "sample-rows").text
    assert "not embedded" in browser.find_element("id", "sample-count").text
    browser.find_element("css selector", "#f-correct option[value='false']").click()
    wrong = browser.execute_script(count)
    assert 0 < wrong < 64
    browser.find_element("id", "f-reward-min").send_keys("0.5")
    paid = browser.execute_script(count)
    assert 0 < paid < wrong
    assert PAID_WRONG_RESPONSE in browser.find_element("id", "sample-rows").text
    assert severe(browser) == []


def test_warnings_lead_to_their_samples_and_a_prompt_is_followed(browser, report):
    open_page(browser, report)
    kinds = browser.execute_script("return [...document.querySelectorAll('#warning-items li')].map(li => li.dataset.kind)")
    assert kinds[0] == "reward_without_correctness" and "stall" in kinds
    browser.find_element("css selector", "#warning-items li button").click()
    rows = browser.find_element("id", "sample-rows").text
    assert PAID_WRONG_RESPONSE in rows and KNOWN_RESPONSE not in rows
    follow = browser.execute_script("return document.querySelectorAll('#follow tr').length")
    assert follow == 1 + 8  # a header, then the prompt at each of the 8 validations
    # the warning set task, correctness and reward: clear them as a user would
    browser.find_element("css selector", "#f-task option[value='']").click()
    browser.find_element("css selector", "#f-correct option[value='']").click()
    browser.find_element("id", "f-reward-min").send_keys(Keys.BACKSPACE * 10)
    assert browser.execute_script("return document.querySelectorAll('#sample-rows .turn').length") == 2  # one episode
    assert "You found the exit." in browser.find_element("id", "sample-rows").text
    assert severe(browser) == []


def test_a_run_without_rollouts_says_so(browser, tmp_path):
    run = make_run(str(tmp_path / "old_run"), steps=6, rollouts=False)
    open_page(browser, write_report(run))
    assert "no rollouts/ folder" in browser.find_element("id", "sample-note").text
    assert browser.execute_script("return document.querySelectorAll('#charts svg path.series').length") > 0
    assert severe(browser) == []


def test_a_run_just_started_opens_without_an_error(browser, tmp_path):
    # metrics.jsonl created but empty, rollouts/ without a step file: the page at a run's first report
    run = tmp_path / "fresh"
    (run / "rollouts").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    open_page(browser, write_report(str(run)))
    assert "No curve keys" in browser.find_element("id", "charts").text
    assert "no readable step file" in browser.find_element("id", "sample-note").text
    assert severe(browser) == []
