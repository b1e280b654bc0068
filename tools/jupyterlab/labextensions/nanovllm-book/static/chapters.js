// A JupyterLab plugin, written by hand so that it needs no build step (tools/lab.py loads it with
// --LabApp.extra_labextensions_path): it gives the book's chapters a file type of their own.
//
// JupyterLab picks a file's default viewer by file type, and a file type by the file's *name*
// (an extension, or a pattern on the name), never by its folder. Making every .py file open as a
// jupytext notebook therefore opened the package's generated modules as notebooks too, and saving
// one rewrote it. So the chapters get their own type, "book-chapter", matched by their names
// (NN_topic.py, NNb_topic.py, or a letter for an appendix: A_visualization.py), which no Python
// module can carry (a module name cannot start with a digit); tests/book/test_lab.py checks that
// the pattern names every chapter and no other .py file of the repository. Its default viewer is
// set to "Jupytext Notebook" in ../../overrides.json; every other .py file keeps JupyterLab's own
// default, the text editor.
//
// It also keeps the left sidebar out of the way on a narrow screen (a phone: 390 px): JupyterLab
// restores it open (the tree/ URL ./dev lab prints shows the file browser), and a notebook beside
// it was 62 px wide. JupyterLab has no setting for this (its shell's startMode and layout settings
// do not depend on the window's width), so on a narrow window the sidebar is collapsed once
// JupyterLab has restored its layout, and again whenever a document becomes the current tab
// (opened from the file browser, which then gives the notebook the whole width).
(function () {
  // CHAPTER_NAME (tests read this line)
  const CHAPTER_NAME = '^(\\d\\d[a-z]?|[A-Z])_[a-z0-9_]+\\.py$';
  const NARROW = '(max-width: 760px)';

  const plugin = {
    id: 'nanovllm-book:chapters',
    description: 'The chapters of the book open as notebooks; other Python files open as text.',
    autoStart: true,
    activate: app => {
      const registry = app.docRegistry;
      const notebook = registry.getFileType('notebook');
      registry.addFileType(
        {
          name: 'book-chapter',
          displayName: 'Chapter (jupytext notebook)',
          extensions: [],
          pattern: CHAPTER_NAME,
          mimeTypes: ['text/x-python'],
          contentType: 'file',
          fileFormat: 'text',
          icon: notebook ? notebook.icon : undefined
        },
        // The viewers that can open a chapter: "Open With" offers both.
        ['Jupytext Notebook', 'Editor']
      );
      const shell = app.shell;
      const collapseIfNarrow = () => {
        if (window.matchMedia(NARROW).matches && typeof shell.collapseLeft === 'function') {
          shell.collapseLeft();
        }
      };
      app.restored.then(collapseIfNarrow);
      if (shell.currentChanged) {
        shell.currentChanged.connect((_, change) => {
          if (change.newValue) {
            collapseIfNarrow();
          }
        });
      }
    }
  };

  // The module-federation container JupyterLab loads extensions from (what a webpack build makes).
  const modules = { './extension': () => ({ __esModule: true, default: [plugin] }) };
  window._JUPYTERLAB = window._JUPYTERLAB || {};
  window._JUPYTERLAB['nanovllm-book'] = {
    get: module => Promise.resolve(modules[module]),
    init: () => Promise.resolve()
  };
})();
