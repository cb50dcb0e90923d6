"""Pure scheduling policies, `plan(state) -> Plan`.

Not built yet: see the policies issue. Nothing is exported so far.
"""

__all__: list[str] = []
