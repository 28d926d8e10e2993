"""`sglang_compact.logs.log_once`: a line logged once per process per key, through the caller's own logger."""

import logging

from sglang_compact import logs


def test_a_line_is_logged_once_per_key_until_reset(caplog):
    log = logging.getLogger("sglang_compact.test_logs")
    logs.reset()
    with caplog.at_level(logging.WARNING, logger=log.name):
        for n in (1, 2):
            logs.log_once(log, logging.WARNING, "rows of %d pages", n)            # key: the format string
            logs.log_once(log, logging.ERROR, "no match", exc_info=True)
        logs.reset()
        logs.log_once(log, logging.WARNING, "rows of %d pages", 3)
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [(log.name, "WARNING", "rows of 1 pages"), (log.name, "ERROR", "no match"),
                    (log.name, "WARNING", "rows of 3 pages")]
    assert all(r.filename == "test_logs.py" for r in caplog.records)   # the caller's line, not log_once's
