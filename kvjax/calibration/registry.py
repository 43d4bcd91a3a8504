"""The methods ``kvjax calibrate`` makes head-role artifacts for: one :class:`kvjax.calibration.HeadRoleCalibrator`
per method, from its module in this package. A new calibrated method adds its module and one entry here."""

from __future__ import annotations

from kvjax.calibration import heterocache, synckv

CALIBRATORS = {c.kind: c for c in (heterocache.CALIBRATOR, synckv.CALIBRATOR)}
