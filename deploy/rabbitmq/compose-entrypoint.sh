#!/bin/bash
# docker-compose.yml's RabbitMQ: starts the broker (which loads the
# definitions, where the application user has no password yet), then gives
# that user the password in $AMQP_PASSWORD. The healthcheck logs in as that
# user, so the workers start only once it can.
set -euo pipefail
: "${AMQP_PASSWORD:?AMQP_PASSWORD must be set}"

# DRAW_SHARDS > 1 spreads draws through an x-random exchange (a plugin that
# ships with RabbitMQ).
rabbitmq-plugins enable --offline rabbitmq_random_exchange >/dev/null

docker-entrypoint.sh rabbitmq-server &
broker=$!
trap 'kill -TERM "$broker"; wait "$broker"' TERM INT

rabbitmqctl --timeout 120 await_startup
rabbitmqctl -q change_password prizepool "$AMQP_PASSWORD"
wait "$broker"
