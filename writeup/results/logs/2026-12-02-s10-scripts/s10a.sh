#!/usr/bin/env bash
bash tools/gpu_leaderboard_proxy.sh
