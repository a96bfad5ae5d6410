"""Reference pages rendered from the code itself, so the docs site cannot drift from it.

``cli.py`` walks the Typer app's command tree; ``rest.py`` renders a FastAPI app's OpenAPI schema. Both
return Markdown; the MkDocs hook (``scripts/mkdocs_hooks.py``) adds them to the site at build time and
``tests/unit/test_docs.py`` checks they cover every command and route.
"""
