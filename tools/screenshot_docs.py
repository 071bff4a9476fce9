"""Screenshots of the built documentation site in headless Chromium (selenium).

    mkdocs build --strict -d /tmp/site
    python tools/screenshot_docs.py /tmp/site docs/images

writes site_front_page.png (the front page) and site_api_attention.png (the API page
of mhsa.core.attention). Needs chromium and chromium-driver (Debian) and selenium.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

PAGES = (
    ("index.html", "site_front_page.png"),
    ("api/attention/index.html", "site_api_attention.png"),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the folder mkdocs built")
    parser.add_argument("out", type=Path, help="where the PNG files go")
    args = parser.parse_args(argv)
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        for page, name in PAGES:
            driver.get((args.site.resolve() / page).as_uri())
            driver.save_screenshot(str(args.out / name))
            print(f"wrote {args.out / name} ({driver.title})")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
