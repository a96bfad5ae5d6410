"""Root conftest: fixtures every suite may ask for by name (a session registry with the fixture images);
nothing starts until a test requests it."""

pytest_plugins = ["tests.fixtures.plugin"]
