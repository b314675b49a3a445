"""MkDocs hook: the course notebooks as pages under notebooks/, read where they are.

The notebooks stay in notebooks/, where the tests and nbval run them; a symlink docs/course would
break tools that copy the repository's files one by one (tests/test_binder.py does).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the .ipynb files into pages
def on_files(files: Files, config: MkDocsConfig) -> Files:
    # a real file whose docs directory is the repository's root (mkdocs-jupyter reads abs_src_path,
    # which a File.generated one does not keep through its wrapper)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        uri = f"notebooks/{notebook.name}"
        files.append(File(uri, str(ROOT), config.site_dir, config.use_directory_urls))
    return files
