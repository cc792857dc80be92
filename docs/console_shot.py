"""The console of a running `flywheel demo` (or any `flywheel up`), checked in headless
Chromium: signs in, waits for the acceptance chart, prints one JSON line with the versions
that have a series and the served version, and saves a screenshot.

    .venv/bin/python docs/console_shot.py http://127.0.0.1:PORT console.png

The demo prints its URL (`live: http://127.0.0.1:PORT serves v0`). How docs/console.png is
made; tests/app/api/test_console_browser.py checks the same page in the suite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402


def main() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("screenshot")
    parser.add_argument("--token", help="the admin token (default: FLYWHEEL_ADMIN_TOKEN, "
                        "else the one the data dir of FLYWHEEL_DATA_DIR keeps)")
    parser.add_argument("--min-series", type=int, default=2)
    args = parser.parse_args()
    token = args.token or Settings().admin_secret().get_secret_value()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options,
                              service=Service(executable_path=shutil.which("chromedriver")))
    try:
        driver.get(f"{args.url}/console")
        driver.find_element(By.CSS_SELECTOR, "#token").send_keys(token)
        driver.find_element(By.CSS_SELECTOR, "#login-button").click()
        series = "#acceptance-chart polyline.series"
        WebDriverWait(driver, 120, poll_frequency=0.5).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, series)) >= args.min_series)
        time.sleep(4)  # one more poll of the page
        versions = sorted({e.get_attribute("data-version")
                           for e in driver.find_elements(By.CSS_SELECTOR, series)}, key=int)
        served = driver.find_element(By.CSS_SELECTOR, "#served").get_attribute("data-version")
        driver.save_screenshot(args.screenshot)
        print(json.dumps({"series_versions": versions, "served": served}))
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
