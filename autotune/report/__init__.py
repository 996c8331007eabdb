"""Reports: ``report.html`` and ``report.md`` with PNG plots from a study.

``write_report(study_name, storage, out_dir) -> ReportPaths`` is what ``search`` and
``ceiling`` call at their end and what ``autotune report`` runs.
"""

from __future__ import annotations

from autotune.report.build import ReportPaths, gather, write_report
from autotune.report.data import ReportError, StudyData, default_storage, load_study

__all__ = ["ReportError", "ReportPaths", "StudyData", "default_storage", "gather",
           "load_study", "write_report"]
