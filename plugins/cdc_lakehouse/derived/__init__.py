"""Derived layers: tables computed from current lake tables, each with its own watermark.

Runs on the Spark driver; `config` is pure Python (DAG files read it at parse time).

  config    derived-table YAML (include/derived/*.yaml) validated into TreeConfig
  tree      the tree derivation's DataFrame steps: pointer jumping, grant sets, reasons
  derive_tree  one run of a derived tree: pin inputs, plan, affected nodes, resolve, commit
"""
