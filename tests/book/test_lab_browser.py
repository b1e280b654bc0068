"""``./dev lab`` in a real browser: what a reader sees when they double-click a file in JupyterLab.

The server is started as ``./dev lab`` starts it (``python -m tools.lab``, through test_lab.py's
``Lab``), rooted at a copy of the book with one package module and chapter 02 executed in both
languages (``build/executed/``, as ``python -m tools.book execute`` writes it), its Jupyter settings,
signatures and workspaces in a temporary home, JupyterLab's autosave set to one second; headless
Chromium drives it over the DevTools protocol (tests/core/test_viz_browser.py's ``Browser``), with
real double-clicks in the file browser. Skipped only when Chromium or JupyterLab is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("jupyterlab")

from tests.book.test_lab import ROOT, Lab, copy_of_the_book
from tests.core.test_viz_browser import CHROMIUM, Browser
from tools import book, lab

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
PACKAGE_FILE = "nanovllm/engine/scheduler.py"
EXECUTED_CHAPTER = "02_block_manager"  # a player, an SVG figure and printed traces, executed in about 3 s a language
AUTOSAVE_S = 1
CJK_TEXT = re.compile(r"[\u4e00-\u9fff]{12}")  # a Chinese phrase (a quoted word or two is not one)


def executed_book(root: Path) -> Path:
    """The copy of the book at ``root``, with one chapter executed in both languages, as ``./dev run`` leaves it."""
    book.execute([root / "notebooks" / f"{EXECUTED_CHAPTER}.py"], root / lab.EXECUTED)
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = executed_book(copy_of_the_book(tmp_path_factory.mktemp("book")))
    (root / PACKAGE_FILE).parent.mkdir(parents=True)
    shutil.copy(ROOT / PACKAGE_FILE, root / PACKAGE_FILE)
    server = Lab(root, tmp_path_factory.mktemp("home"), extra=("--expose-app-in-browser",), autosave_s=AUTOSAVE_S)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = Browser(CHROMIUM)
    try:
        yield chromium
    finally:
        chromium.close()


def run_js(browser: Browser, expression: str, timeout_s: float = 30) -> object:
    """Evaluate ``expression`` in the page, awaiting it (for at most ``timeout_s``) if it is a promise."""
    raced = (f"Promise.race([Promise.resolve({expression}), new Promise((_, no) => setTimeout("
             f"() => no(new Error('no answer in {timeout_s} s')), {int(timeout_s * 1000)}))])")
    result = browser.page("Runtime.evaluate", expression=raced, returnByValue=True, awaitPromise=True)
    if "exceptionDetails" in result:
        raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
    return result["result"].get("value")


def wait_for(browser: Browser, expression: str, what: str, timeout_s: float = 30) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = run_js(browser, expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still {value!r} after {timeout_s} s")
        time.sleep(0.1)


def open_lab(browser: Browser, url: str) -> None:
    """Load JupyterLab at ``url`` and wait until it has restored its workspace."""
    # Leaving a page with a modified notebook asks "Leave site?", which would hold the navigation:
    # the reader would answer yes here (what was worth keeping is saved).
    browser.js("window.addEventListener('beforeunload', e => e.stopImmediatePropagation(), true)")
    browser.open(url)
    wait_for(browser, "!!window.jupyterapp", "JupyterLab did not start in the page")
    run_js(browser, "jupyterapp.restored")


# What the reader sees in the main area: one entry per tab.
TABS_JS = """[...jupyterapp.shell.widgets('main')].map(w => ({
  label: w.title.label, path: w.context ? w.context.path : null,
  notebook: w.node.classList.contains('jp-NotebookPanel'),
  editor: !!(w.content && w.content.node.classList.contains('jp-FileEditor')),
  ready: !!(w.context && w.context.isReady), dirty: !!(w.context && w.context.model.dirty)}))"""


def tabs(browser: Browser) -> list[dict]:
    return run_js(browser, TABS_JS)


def url(served: Lab, lang: str, folder: str | None = None) -> str:
    """The URL ``./dev lab [lang]`` prints (for this server), or one that shows another folder in that workspace."""
    printed = lab.Server(port=served.port, token=served.token, lang=lang).url()
    return printed if folder is None else printed.replace(f"/tree/read/{lang}", f"/tree/{folder}")


def double_click_in_file_browser(browser: Browser, path: str) -> dict:
    """Double-click the file's name in JupyterLab's file browser (showing its folder); return its tab once open."""
    name = path.rsplit("/", 1)[-1]
    item = ("[...document.querySelectorAll('.jp-DirListing-item')].find(e => e.querySelector("
            f"'.jp-DirListing-itemText').textContent === {json.dumps(name)})")
    wait_for(browser, f"!!{item}", f"{name} is not listed")
    x, y = run_js(browser, f"(() => {{ const r = {item}.getBoundingClientRect(); "
                           "return [r.x + 40, r.y + r.height / 2]; })()")
    for clicks in (1, 2):
        for kind in ("mousePressed", "mouseReleased"):
            browser.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=clicks)
    tab = f"({TABS_JS}).find(t => t.path === {json.dumps(path)} && t.ready)"
    return wait_for(browser, tab, f"{path} did not open")


def sessions(served: Lab) -> dict[str, str]:
    """The kernels the server runs, by the path of the document that started them."""
    return {s["path"]: s["kernel"]["name"] for s in served.get("/api/sessions")}


def wait_for_the_kernel(browser: Browser) -> None:
    """Until the current notebook's kernel is idle, its session under the notebook's path (JupyterLab first
    starts a session under a random name, then renames it: leaving the page before that leaves the name)."""
    wait_for(browser, "(() => { const w = jupyterapp.shell.currentWidget, s = w.sessionContext.session;"
             " return !!s && s.path === w.context.path && s.kernel.status === 'idle'; })()",
             "the notebook's kernel did not start")


def save_current(browser: Browser) -> None:
    run_js(browser, "jupyterapp.commands.execute('docmanager:save').then(() => true)")


def text_once_saved(path: Path, expected: str, timeout_s: float = 15) -> str:
    """``path``'s text once it holds ``expected`` (or after ``timeout_s``). The save command resolves when the
    server answers, but an autosave that the same edit started may still be rewriting the file (it read empty
    once, in CI)."""
    deadline = time.monotonic() + timeout_s
    while expected not in (text := path.read_text(encoding="utf-8")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return text


def current_cells(browser: Browser) -> list[dict]:
    return run_js(browser, "jupyterapp.shell.currentWidget.context.model.toJSON().cells")


def test_a_package_file_opens_as_text_and_is_never_rewritten(served: Lab, browser: Browser) -> None:
    """Item 1: it opened as a notebook, with a kernel dialog, and autosave added jupytext's header."""
    before = (served.root / PACKAGE_FILE).read_bytes()
    open_lab(browser, url(served, "en", "nanovllm/engine"))
    tab = double_click_in_file_browser(browser, PACKAGE_FILE)
    assert tab["editor"] and not tab["notebook"], tab
    assert not run_js(browser, "!!document.querySelector('.jp-Dialog')")  # no "Select Kernel"
    time.sleep(AUTOSAVE_S * 2.5)  # autosave's turn came and went
    (now,) = [t for t in tabs(browser) if t["path"] == PACKAGE_FILE]
    assert not now["dirty"] and PACKAGE_FILE not in sessions(served)
    assert (served.root / PACKAGE_FILE).read_bytes() == before
    save_current(browser)  # a save without an edit writes back exactly what was read
    assert (served.root / PACKAGE_FILE).read_bytes() == before


def test_a_chapter_opens_as_a_notebook_and_saving_it_unedited_changes_nothing(served: Lab, browser: Browser) -> None:
    chapter = "notebooks/04_scheduler.py"
    before = (served.root / chapter).read_bytes()
    open_lab(browser, url(served, "en", "notebooks"))
    tab = double_click_in_file_browser(browser, chapter)
    assert tab["notebook"] and not tab["editor"], tab
    cells = current_cells(browser)
    assert len(cells) > 20 and {"en", "zh"} <= {t for c in cells for t in c["metadata"].get("tags", [])}
    wait_for_the_kernel(browser)
    time.sleep(AUTOSAVE_S * 2.5)
    # It was marked unsaved (JupyterLab added a language_info, then the kernel its own): tools/lab_contents.py.
    assert run_js(browser, "jupyterapp.shell.currentWidget.context.model.dirty") is False
    save_current(browser)
    assert (served.root / chapter).read_bytes() == before


def test_each_language_has_its_own_workspace_and_its_tabs_say_which(served: Lab, browser: Browser) -> None:
    """Item 3: ``./dev lab zh`` reopened the English tabs (one default workspace), named like the Chinese ones."""
    english, chinese = "read/en/04_scheduler.en.ipynb", "read/zh/04_scheduler.zh.ipynb"
    assert served.url == url(served, "en")  # what `./dev lab` printed
    open_lab(browser, served.url)
    assert double_click_in_file_browser(browser, english)["label"] == "04_scheduler.en.ipynb"
    wait_for_the_kernel(browser)
    # JupyterLab saves the open tabs in the workspace named in the URL, shortly after a change.
    wait_for(browser, "fetch('/lab/api/workspaces/nanovllm-en').then(r => r.text()).then(t => t.includes("
             f"{json.dumps(english)}))", "the English workspace was not saved")
    running = set(sessions(served))

    open_lab(browser, url(served, "zh"))  # what `./dev lab zh` prints
    assert all(not t["path"].startswith("read/en/") for t in tabs(browser)), tabs(browser)
    assert double_click_in_file_browser(browser, chinese)["label"] == "04_scheduler.zh.ipynb"
    wait_for_the_kernel(browser)
    assert set(sessions(served)) - running == {chinese}  # no English copy started a kernel again

    open_lab(browser, served.url)  # and the English session is still there, without the Chinese tab
    wait_for(browser, f"({TABS_JS}).some(t => t.path === {json.dumps(english)})", "the English tab is gone")
    assert all(not t["path"].startswith("read/zh/") for t in tabs(browser)), tabs(browser)


def test_a_reading_copy_opens_unmodified_says_where_edits_go_and_keeps_the_readers_notes(
        served: Lab, browser: Browser) -> None:
    """Item 4: notes typed into a copy were lost at the next ``./dev lab``; copies opened marked unsaved."""
    copy = "read/zh/02_block_manager.zh.ipynb"
    before = (served.root / copy).read_bytes()
    open_lab(browser, url(served, "zh"))
    double_click_in_file_browser(browser, copy)
    wait_for_the_kernel(browser)
    time.sleep(AUTOSAVE_S * 2.5)  # a copy marked modified would have been autosaved by now
    assert run_js(browser, "jupyterapp.shell.currentWidget.context.model.dirty") is False
    assert (served.root / copy).read_bytes() == before
    banner = run_js(browser, "jupyterapp.shell.currentWidget.content.widgets[0].node.innerText")
    assert "notebooks/02_block_manager.py" in banner and "阅读副本" in banner and "保留" in banner
    save_current(browser)  # saved by JupyterLab, in its own layout, but not edited: no note to keep
    done = lab.write_reading_copies(root=served.root)
    assert served.root / copy not in done.kept + done.written and done.report(served.root) == []

    run_js(browser, "void jupyterapp.shell.currentWidget.content.model.sharedModel.insertCell(3, "
           "{cell_type: 'markdown', source: '我的笔记：块表就是页表。'})")
    save_current(browser)
    assert "我的笔记" in text_once_saved(served.root / copy, "我的笔记")
    done = lab.write_reading_copies(root=served.root)  # what the next `./dev lab` does first
    assert served.root / copy in done.kept and "我的笔记" in (served.root / copy).read_text()
    assert f"lab: {copy} holds your edits: kept as it is." in done.report(served.root)
    assert served.root / copy.replace("zh", "en") not in done.kept  # the English copy was not edited


def test_on_a_phone_the_sidebar_starts_collapsed_and_a_notebook_gets_the_width(served: Lab, browser: Browser) -> None:
    """At 390 px the file browser stayed open and the notebook beside it was 62 px wide."""
    browser.page("Emulation.setDeviceMetricsOverride", width=390, height=800, deviceScaleFactor=1, mobile=True)
    try:  # a workspace of its own: the layout it saves (sidebar collapsed) reaches no other test
        open_lab(browser, url(served, "en").replace("/nanovllm-en/", "/phone/"))
        wait_for(browser, "jupyterapp.shell.leftCollapsed", "the sidebar is open at 390 px", timeout_s=10)
        run_js(browser, "jupyterapp.commands.execute('filebrowser:activate').then(() => true)")  # the reader opens it
        assert run_js(browser, "jupyterapp.shell.leftCollapsed") is False
        run_js(browser, "jupyterapp.commands.execute('docmanager:open', {path: 'read/en/01_sequence.en.ipynb'})"
                        ".then(w => w.context.ready).then(() => true)")
        wait_for(browser, "jupyterapp.shell.leftCollapsed", "the sidebar stayed open over the notebook", timeout_s=10)
        width = run_js(browser, "jupyterapp.shell.currentWidget.node.getBoundingClientRect().width")
        assert width > 300, width
    finally:
        browser.page("Emulation.clearDeviceMetricsOverride")


# ---- a reading copy opens with the executed book's outputs (issue 59, item 4) ----------------------------------

# What the current notebook shows: its outputs, players whose script ran, SVG figures drawn as images.
SHOWN_JS = """(() => { const n = jupyterapp.shell.currentWidget.content.node;
  const player = n.querySelector('.nvv[data-ready="1"]');
  return {outputs: n.querySelectorAll('.jp-OutputArea-output').length,
          players: n.querySelectorAll('.nvv[data-ready="1"]').length, player: player ? player.textContent : '',
          figures: n.querySelectorAll('.jp-RenderedSVG svg, .jp-RenderedSVG img').length,
          text: n.innerText}; })()"""
# Every resource the page loaded, from any origin other than the server's own (data: and blob: are the page's).
OUTSIDE_JS = """performance.getEntriesByType('resource').map(e => e.name)
  .filter(u => !u.startsWith(location.origin) && !u.startsWith('data:') && !u.startsWith('blob:'))"""


def scroll_through(browser: Browser) -> None:
    """Scroll the notebook from top to bottom, so that JupyterLab renders every cell it would render lazily."""
    run_js(browser, """(async () => { const n = jupyterapp.shell.currentWidget.content;
      for (let i = 0; i < n.widgets.length; i++) { await n.scrollToItem(i, 'start'); }
      await n.scrollToItem(0, 'start'); return true; })()""", timeout_s=60)


def test_a_reading_copy_opens_with_the_executed_books_outputs_and_saving_it_unedited_changes_nothing(
        served: Lab, browser: Browser) -> None:
    """Item 4 of issue 59: 27 of 29 copies opened bare, until Run All (two minutes for chapter 17)."""
    copy = f"read/en/{EXECUTED_CHAPTER}.en.ipynb"
    before = (served.root / copy).read_bytes()
    saved = json.loads(before)
    assert saved["metadata"][lab.RECORD]["outputs"] == "executed"
    # The answers' outputs are folded with them (their cells say so), the others shown.
    outputs = sum(len(c.get("outputs", [])) for c in saved["cells"]
                  if not c["metadata"].get("jupyter", {}).get("outputs_hidden"))
    open_lab(browser, url(served, "en"))
    double_click_in_file_browser(browser, copy)
    scroll_through(browser)
    shown = wait_for(browser, f"(s => s.players && s.figures && s)({SHOWN_JS})",
                     "the player's script did not run or the figure was not drawn (an untrusted notebook)")
    assert shown["outputs"] == outputs > 10, shown["outputs"]  # every output, none run by a kernel
    assert "The outputs are the executed book's" in shown["text"] and not CJK_TEXT.search(shown["text"])
    assert "Back" in shown["player"] and "后退" not in shown["player"]
    assert run_js(browser, OUTSIDE_JS) == []  # nothing fetched from outside the machine
    wait_for_the_kernel(browser)
    time.sleep(AUTOSAVE_S * 2.5)  # a copy marked modified would have been autosaved by now
    assert run_js(browser, "jupyterapp.shell.currentWidget.context.model.dirty") is False
    assert (served.root / copy).read_bytes() == before
    save_current(browser)  # JupyterLab holds printed outputs joined; the copy has them so already
    assert (served.root / copy).read_bytes() == before
    assert served.root / copy in lab.write_reading_copies(root=served.root).generated  # still ours, still signed


@pytest.fixture(scope="module")
def served_in_chinese(served: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """``./dev lab zh``: a server of its own (JupyterLab's language is the server's setting), on a book executed
    as ``served``'s is."""
    root = copy_of_the_book(tmp_path_factory.mktemp("book"))
    shutil.copytree(served.root / lab.EXECUTED, root / lab.EXECUTED)
    server = Lab(root, tmp_path_factory.mktemp("home"), lang="zh", extra=("--expose-app-in-browser",))
    try:
        yield server
    finally:
        server.stop()


def test_the_chinese_lab_speaks_chinese_menus_and_copies_included(served_in_chinese: Lab, browser: Browser) -> None:
    """Item 4 of issue 59: ``./dev lab zh`` left JupyterLab's own menus in English."""
    open_lab(browser, served_in_chinese.url)
    menus = run_js(browser, "[...document.querySelectorAll('.lm-MenuBar-itemLabel')].map(e => e.textContent)")
    assert {"文件", "编辑", "运行"} <= set(menus), menus  # the language pack's File, Edit, Run
    double_click_in_file_browser(browser, f"read/zh/{EXECUTED_CHAPTER}.zh.ipynb")
    scroll_through(browser)
    shown = wait_for(browser, f"(s => s.players && s)({SHOWN_JS})", "the player's script did not run")
    assert "下面的输出来自执行过的全书" in shown["text"]  # the note: the executed book's outputs
    assert "后退" in shown["player"] and "Back" not in shown["player"]  # the player, in Chinese
    assert run_js(browser, OUTSIDE_JS) == []
