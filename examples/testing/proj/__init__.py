"""A small project with capped tasks, and the tests a user writes for them (``tests/``)."""
