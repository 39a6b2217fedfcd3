// A real third-party libp2p peer for peertrain's interop test.
// usage: node --import ./polyfill.mjs peer.mjs <node multiaddr> <node peer id> <run-id>
// Prints one JSON line per step; exits 0 when every step passed.
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { kadDHT, passthroughMapper } from '@libp2p/kad-dht'
import { gossipsub } from '@libp2p/gossipsub'
import { multiaddr } from '@multiformats/multiaddr'

const [addr, peerId, runId] = process.argv.slice(2)
const say = (doc) => console.log(JSON.stringify(doc))
const hex = (bytes) => Buffer.from(bytes).toString('hex')
const withTimeout = (ms, what, promise) => Promise.race([
  promise,
  new Promise((_, reject) => setTimeout(() => reject(new Error(`${what}: timed out after ${ms} ms`)), ms))
])

const node = await createLibp2p({
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: {
    identify: identify(),
    ping: ping(),
    dht: kadDHT({
      protocol: '/peertrain/kad/1.0.0', // peertrain's own DHT, not the public IPFS one
      clientMode: false,
      peerInfoMapper: passthroughMapper, // keep loopback peers in the routing table
      validators: { ptpeer: async () => {} }, // the python side verifies the signature
      selectors: { ptpeer: () => 0 }
    }),
    pubsub: gossipsub({ allowPublishToZeroTopicPeers: true })
  }
})

let failed = false
async function step (name, ms, fn) {
  try {
    const result = await withTimeout(ms, name, fn())
    say({ step: name, ok: true, ...result })
  } catch (e) {
    failed = true
    say({ step: name, ok: false, error: String(e?.message ?? e) })
  }
}

try {
  const topic = `/peertrain/${runId}/hb/1`
  const got = new Promise((resolve) => {
    node.services.pubsub.addEventListener('message', (evt) => {
      const m = evt.detail
      if (m.topic === topic) resolve({ from: m.from?.toString(), data: hex(m.data) })
    })
  })
  node.services.pubsub.subscribe(topic)

  await step('connect', 10000, async () => {
    const conn = await node.dial(multiaddr(addr))
    return { remote: conn.remotePeer.toString() }
  })
  await step('ping', 10000, async () => {
    for (let attempt = 1; ; attempt++) {
      try {
        return { rtt_ms: await node.services.ping.ping(multiaddr(addr)), attempt }
      } catch (e) { // js ping allows one outbound stream; it can race the DHT's own ping
        if (attempt >= 5) throw e
        await new Promise((resolve) => setTimeout(resolve, 200))
      }
    }
  })
  await step('dht-get', 20000, async () => {
    const key = new TextEncoder().encode(`/ptpeer/${peerId}`)
    for (let attempt = 1; attempt <= 20; attempt++) {
      for await (const event of node.services.dht.get(key)) {
        if (event.name === 'VALUE') return { key: `/ptpeer/${peerId}`, value: hex(event.value), attempt }
      }
      await new Promise((resolve) => setTimeout(resolve, 500)) // the record may not be out yet
    }
    throw new Error('no value found')
  })
  await step('gossip', 20000, async () => await got)
} finally {
  await node.stop()
}
process.exit(failed ? 1 : 0)
