"""The integration tests share one scenario module; its checks report their values when they fail."""

import pytest

pytest.register_assert_rewrite("tests.integrations.scenario")
