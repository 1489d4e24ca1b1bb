"""Bootstrap directory put first on PYTHONPATH by ``opguard.capture.bootstrap.child_env``
(a package only so that installs ship ``sitecustomize.py``)."""
