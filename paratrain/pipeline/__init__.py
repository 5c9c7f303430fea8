"""Pipeline parallelism: schedules as data (schedules.py, schedules_zb.py), the stage split, the
executor. Importing the package registers the zero-bubble schedules in ``schedules.SCHEDULES``, so
``make_schedule`` knows every schedule whichever module a caller imports it from."""

from paratrain.pipeline import schedules_zb  # noqa: F401 - registers zb-h1, zbv, dualpipev
