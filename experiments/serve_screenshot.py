"""Screenshot of the calculator page answering a job: README's docs/serve.png by default
(README command 1's job as a shared URL).

    python experiments/serve_screenshot.py [--out docs/serve.png] [--query 'model=...']

Needs the serve extra, selenium and Debian's chromium + chromium-driver (as tests/test_serve.py).
The trace tier runs in a thread of the server here (`--query` with method=trace draws the
timeline).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time

README_QUERY = ("model=llava-1.5-7b&micro_batch=8&seq_len=2048&train=llm%2Bprojector"
                "&grad_ckpt=true&precision=bf16-master&gpu=h100-80gb&find_max_batch=true")
"""README command 1: `hybridmem predict --model llava-1.5-7b --micro-batch 8 --seq-len 2048
--train llm+projector --grad-ckpt --precision bf16-master --gpu h100-80gb --find-max-batch`."""


def serve() -> tuple[object, str]:
    import uvicorn

    from hybridmem.serve.app import Settings, create_app
    from hybridmem.serve.pool import AnswerPool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = AnswerPool(1, 1, in_thread=True)  # a trace in a thread: no second torch import
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(workers=0, pool=pool)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/serve.png")
    parser.add_argument("--query", default=README_QUERY)
    parser.add_argument("--size", default="1400,900", help="window width,height in pixels "
                        "(1400,900: the verdict must show without scrolling)")
    args = parser.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server, url = serve()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.size}",
                "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        # --window-size is the window's; the page gets what the window's frame leaves, so grow
        # the window until the page itself is `--size`
        width, height = map(int, args.size.split(","))
        inner = browser.execute_script("return [window.innerWidth, window.innerHeight]")
        browser.set_window_size(2 * width - inner[0], 2 * height - inner[1])
        browser.get(f"{url}/?{args.query}")
        WebDriverWait(browser, 600).until(lambda b: b.find_elements(By.ID, "verdict"))
        browser.save_screenshot(args.out)
        verdict = browser.find_element(By.ID, "verdict")
        inner = browser.execute_script("return [window.innerWidth, window.innerHeight]")
        shown = verdict.rect["y"] + verdict.rect["height"] <= inner[1]
        print(f"{args.out} ({inner[0]}x{inner[1]} page; the verdict "
              f"{'shows without scrolling' if shown else 'is below the fold'}): {verdict.text}")
    finally:
        browser.quit()
        server.should_exit = True


if __name__ == "__main__":
    main()
