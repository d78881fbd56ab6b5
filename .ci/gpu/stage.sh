#!/usr/bin/env bash
# Part calls: keep this call's parts on the machine (/tmp/stage), outside the copied tree.
mkdir -p /tmp/stage && cp "$@" /tmp/stage/ && ls -la /tmp/stage && df -h /tmp | tail -1
