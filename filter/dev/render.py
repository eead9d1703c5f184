#!/usr/bin/env python3
"""Dev-only: render envoy/bootstrap.yaml.j2 with Jinja2 from a JSON file of variables.
(The shipped renderer is kvmesh_e2e::envoy_config::render_bootstrap.)  usage: render.py VARS.json"""
import json, os, sys
import jinja2

here = os.path.dirname(os.path.abspath(__file__))
env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
tpl = env.from_string(open(os.path.join(here, "../../envoy/bootstrap.yaml.j2")).read())
sys.stdout.write(tpl.render(**json.load(open(sys.argv[1]))))
