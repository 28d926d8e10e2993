"""The layer A/B of session 49: one `quest_budget` 0.3 layer on FA3's rows with the one-window batch call and with
the varlen rows and their two copies, alternated in one process. Run on the GPU host from the repository root
(copied to scripts/gpu/ for the run), after `source scripts/gpu/setup.sh; source scripts/gpu/fa3_library.sh`."""
import sys

sys.path.insert(0, "scripts/gpu")
sys.path.insert(0, ".")

from host_profile import make_layer  # noqa: E402
from sparse_breakdown import event_ms  # noqa: E402

for ctx in (32768, 65536, 131072):
    layer, mode = make_layer("quest_budget", {"density": 0.3}, "sgl-fa3", ctx, 1024)
    exe = [c.cell_contents for c in layer.__closure__ if hasattr(c.cell_contents, "_fa3_rows")][0]
    res = {}
    for rep in range(2):
        for ow in (True, False):
            exe._fa3_rows.one_window = ow
            res.setdefault(ow, []).append(event_ms(layer, 50))
    print(ctx, "one window (batch call):", [round(x, 4) for x in res[True]],
          "rows layout (varlen + copies):", [round(x, 4) for x in res[False]], flush=True)
